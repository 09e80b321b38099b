"""Bad input (SPEC 3.7): a ValueError/TypeError naming the argument, what was given and
what was expected -- raised before any kernel runs."""

import pytest
import torch

import fusedattn


def qkv(b=1, sq=8, sk=8, hq=2, hkv=2, d=16, dv=None, dtype=torch.float16, layout="bshd"):
    def shape(s, h, dim):
        return (b, s, h, dim) if layout == "bshd" else (b, h, s, dim)
    return (torch.randn(shape(sq, hq, d), dtype=dtype), torch.randn(shape(sk, hkv, d), dtype=dtype),
            torch.randn(shape(sk, hkv, dv or d), dtype=dtype))


def with_k(**kw):
    q, k, v = qkv()
    k2 = qkv(**kw)[1]
    return (q, k2, v), {}


BAD_INPUTS = [
    # (description, builder -> (args, kwargs), error type, substrings the message must contain)
    ("q 3-D", lambda: ((qkv()[0][0], *qkv()[1:]), {}), ValueError, ["`q`", "4-D", "(8, 2, 16)"]),
    ("k 5-D", lambda: ((qkv()[0], qkv()[1][None], qkv()[2]), {}), ValueError, ["`k`", "4-D"]),
    ("int dtype", lambda: ((qkv()[0].to(torch.int32), *qkv()[1:]), {}), TypeError, ["`q`", "int32", "float16"]),
    ("float64", lambda: (qkv(dtype=torch.float64), {}), TypeError, ["float64", "expected"]),
    ("mixed dtypes", lambda: ((qkv()[0], qkv()[1].float(), qkv()[2]), {}), TypeError, ["share a dtype"]),
    ("not a tensor", lambda: ((qkv()[0].tolist(), *qkv()[1:]), {}), TypeError, ["`q`", "torch.Tensor", "list"]),
    ("batch mismatch", lambda: with_k(b=2), ValueError, ["batch", "q 1", "k 2"]),
    ("k/v length mismatch", lambda: ((qkv()[0], qkv(sk=9)[1], qkv()[2]), {}), ValueError, ["`k` has 9 keys", "`v` has 8"]),
    ("k/v heads mismatch", lambda: ((qkv()[0], qkv(hkv=1)[1], qkv()[2]), {}), ValueError, ["`k` has 1 heads", "`v` has 2"]),
    ("head ratio", lambda: (qkv(hq=3, hkv=2), {}), ValueError, ["q heads (3)", "multiple of k/v heads (2)"]),
    ("q/k head dims differ", lambda: ((qkv(d=16)[0], *qkv(d=32)[1:]), {}), ValueError, ["head dim 32", "head dim 16"]),
    ("head dim > 256", lambda: (qkv(d=288), {}), ValueError, ["head dim 288", "<= 256"]),
    ("head dim < 8", lambda: (qkv(d=4), {}), ValueError, ["head dim 4", "8 <="]),
    ("v head dim > 256", lambda: (qkv(dv=320), {}), ValueError, ["v head dim 320"]),
    ("unknown layout", lambda: (qkv(), {"layout": "sbhd"}), ValueError, ["`layout`", "'sbhd'", "bshd"]),
    ("layout mismatch", lambda: (qkv(sq=8, sk=16, hq=4, hkv=2), {"layout": "bhsd"}), ValueError, ["layout='bhsd'"]),
    ("softcap 0", lambda: (qkv(), {"softcap": 0.0}), ValueError, ["`softcap`", "> 0", "0.0"]),
    ("softcap negative", lambda: (qkv(), {"softcap": -5.0}), ValueError, ["`softcap`", "-5.0"]),
    ("softcap str", lambda: (qkv(), {"softcap": "30"}), TypeError, ["`softcap`", "str"]),
    ("scale nan", lambda: (qkv(), {"scale": float("nan")}), ValueError, ["`scale`", "finite"]),
    ("window triple", lambda: (qkv(), {"window": (1, 2, 3)}), ValueError, ["`window`", "(1, 2, 3)"]),
    ("window below -1", lambda: (qkv(), {"window": (-2, 0)}), ValueError, ["`window` left", "-2"]),
    ("window float", lambda: (qkv(), {"window": (4.5, 0)}), TypeError, ["`window` left", "float"]),
    ("causal not bool", lambda: (qkv(), {"causal": 1}), TypeError, ["`causal`", "bool", "int"]),
    ("bias int", lambda: (qkv(), {"bias": torch.zeros(1, 2, 8, 8, dtype=torch.int32)}), TypeError,
     ["`bias`", "int32", "float16"]),
    ("bias bool", lambda: (qkv(), {"bias": torch.ones(1, 2, 8, 8, dtype=torch.bool)}), TypeError,
     ["`bias`", "bool", "`mask`"]),
    ("bias wrong queries", lambda: (qkv(), {"bias": torch.zeros(1, 2, 5, 8)}), ValueError,
     ["`bias`", "(1, 2, 5, 8)", "dim Q is 5", "[1, 8]"]),
    ("bias 3 heads of 2", lambda: (qkv(), {"bias": torch.zeros(3, 8, 8)}), ValueError, ["`bias`", "dim H is 3"]),
    ("bias 5-D", lambda: (qkv(), {"bias": torch.zeros(1, 1, 2, 8, 8)}), ValueError, ["`bias`", "at most 4 dims"]),
    ("bias a list", lambda: (qkv(), {"bias": [[0.0]]}), TypeError, ["`bias`", "list"]),
    ("mask of floats", lambda: (qkv(), {"mask": torch.ones(1, 2, 8, 8)}), TypeError, ["`mask`", "bool", "`bias`"]),
    ("mask wrong keys", lambda: (qkv(), {"mask": torch.ones(1, 2, 8, 7, dtype=torch.bool)}), ValueError,
     ["`mask`", "(1, 2, 8, 7)", "dim K is 7", "[1, 8]"]),
    ("mask 3 heads of 2", lambda: (qkv(), {"mask": torch.ones(1, 3, 8, 8, dtype=torch.bool)}), ValueError,
     ["`mask`", "dim H is 3"]),
    ("mask 5-D", lambda: (qkv(), {"mask": torch.ones(1, 1, 2, 8, 8, dtype=torch.bool)}), ValueError,
     ["`mask`", "at most 4 dims"]),
    ("mask a list", lambda: (qkv(), {"mask": [[True]]}), TypeError, ["`mask`", "list", "BlockMask"]),
    ("block mask of other lengths", lambda: (qkv(), {"mask": fusedattn.BlockMask.from_blocks(
        torch.ones(1, 1, dtype=torch.bool), (16, 16), 8, 9)}), ValueError, ["`mask`", "dim K is 9"]),
    ("sinks per kv head", lambda: (qkv(hq=4, hkv=2), {"sinks": torch.zeros(2)}), ValueError,
     ["`sinks`", "(4,)", "(2,)"]),
    ("sinks 2-D", lambda: (qkv(), {"sinks": torch.zeros(1, 2)}), ValueError, ["`sinks`", "(2,)", "(1, 2)"]),
    ("sinks int", lambda: (qkv(), {"sinks": torch.zeros(2, dtype=torch.int64)}), TypeError, ["`sinks`", "int64"]),
    ("sinks a list", lambda: (qkv(), {"sinks": [0.0, 0.0]}), TypeError, ["`sinks`", "list"]),
    ("alibi float16", lambda: (qkv(), {"alibi_slopes": torch.ones(2, dtype=torch.float16)}), TypeError,
     ["`alibi_slopes`", "float32", "float16"]),
    ("alibi per kv head", lambda: (qkv(hq=4, hkv=2), {"alibi_slopes": torch.ones(2)}), ValueError,
     ["`alibi_slopes`", "(4,)", "(1, 4)", "got (2,)"]),
    ("alibi wrong batch", lambda: (qkv(), {"alibi_slopes": torch.ones(3, 2)}), ValueError,
     ["`alibi_slopes`", "(3, 2)"]),
    ("alibi 3-D", lambda: (qkv(), {"alibi_slopes": torch.ones(1, 2, 1)}), ValueError, ["`alibi_slopes`", "(1, 2, 1)"]),
    ("alibi a list", lambda: (qkv(), {"alibi_slopes": [0.5, 0.5]}), TypeError, ["`alibi_slopes`", "list"]),
    ("alibi on another device", lambda: (qkv(), {"alibi_slopes": torch.ones(2, device="meta")}), ValueError,
     ["`alibi_slopes`", "meta", "cpu"]),
    ("chunk zero", lambda: (qkv(), {"chunk": 0}), ValueError, ["`chunk`", ">= 1", "got 0"]),
    ("chunk negative", lambda: (qkv(), {"chunk": -4}), ValueError, ["`chunk`", "got -4"]),
    ("chunk a float", lambda: (qkv(), {"chunk": 8.0}), TypeError, ["`chunk`", "int", "float"]),
    ("chunk a bool", lambda: (qkv(), {"chunk": True}), TypeError, ["`chunk`", "bool"]),
    ("chunk a tensor", lambda: (qkv(), {"chunk": torch.tensor(8)}), TypeError, ["`chunk`", "Tensor"]),
]


@pytest.mark.parametrize("description,build,error,substrings", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(description, build, error, substrings):
    args, kwargs = build()
    with pytest.raises(error) as info:
        fusedattn.attention(*args, **kwargs)
    for s in substrings:
        assert s in str(info.value), f"{description}: {s!r} not in message {str(info.value)!r}"


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="expected one of"):
        with fusedattn.use_backend("cuda-please"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices: CPU and CUDA")
def test_mixed_devices_raise():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        fusedattn.attention(q.cuda(), k, v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_numpy_scalars_are_taken_wherever_a_python_number_is(backend):
    """np.int64 windows, an np.float32 scale and softcap, np.int64 longest lengths: the same results, bit
    for bit, as the Python numbers they hold (NumPy values come from configs and array reductions)."""
    import numpy as np

    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v = (t.to(device) for t in qkv(sq=19, sk=23, hq=4, hkv=2))
    as_numpy = dict(window=(np.int64(7), np.int32(0)), scale=np.float32(0.2), softcap=np.float32(15.0))
    as_python = dict(window=(7, 0), scale=float(np.float32(0.2)), softcap=float(np.float32(15.0)))
    with fusedattn.use_backend(backend):
        got = [fusedattn.attention(q, k, v, return_lse=True, **options) for options in (as_numpy, as_python)]
        cu = torch.tensor([0, 8, 19], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 10, 23], dtype=torch.int32, device=device)
        packed = [fusedattn.varlen_attention(q[0], k[0], v[0], cu, cu_k, longest_q, longest_k, causal=True)
                  for longest_q, longest_k in ((np.int64(11), np.int32(13)), (11, 13))]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.equal(packed[0], packed[1])
