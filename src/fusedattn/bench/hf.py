"""The model rows: training steps of a Hugging Face Llama-3-8B-shaped decoder, one attention
implementation at a time, side by side in one process.

    python -m fusedattn.bench --hf                     # 2 layers, S in {4k, 16k}, and 16k tokens of packed documents
    python -m fusedattn.bench --hf --hf-layers 4 --seqlens 4096 --systems sdpa,fusedattn

The model: ``transformers.LlamaConfig`` with Llama 3 8B's shapes -- hidden 4096, 32 query heads / 8
key-value heads of 128, MLP 14336, rope theta 500000, vocabulary 128256 (``--hf-vocab``), untied
head -- and ``--hf-layers`` decoder layers (default 2: a 16k-token step fits one 80 GB GPU), random
weights (seed 0, nothing downloaded), bf16, built once by ``AutoModelForCausalLM.from_config``; each
system is switched in with ``model.set_attn_implementation`` (the same weights for all).

A training step: forward with labels (transformers' loss, fp32 over the full vocabulary) and backward,
the parameters' gradients set to None after it; no optimizer step, so every step and every system
sees the same weights. Rows:

- ``S=4096``, ``S=16384``: one causal sequence (B=1) for each of sdpa, flex_attention, fusedattn.
- ``packed``: documents of random lengths (seeded, 256 to 4096 tokens) that total 16384. Each system
  padding-free: one row of 16384 tokens whose ``position_ids`` restart at 0 per document (as
  ``DataCollatorWithFlattening`` gives them; the first token of each document has no label).
  fusedattn runs them as varlen sequences; flex_attention gets transformers' packed-sequence block
  mask; sdpa a dense 4-D mask of the same rule. And sdpa (the reference) on the same documents padded
  into a (documents, longest) batch with a 2-D attention mask. Tokens/s count real tokens only.

Before timing, every system's step is checked against the reference's (sdpa; on the packed row sdpa's
padded batch) on the same tokens: the loss, the final hidden states (the LM head's input), the
logits at sampled positions, and the gradients of layer 0's attention projections, each as
||ours - ref|| / ||ref|| (``*_rel_diff``); ``output_agrees`` when all are within ``REL_TOL``.
This first step is also each system's compilation (flex_attention under torch.compile, fusedattn's
Triton kernels). Then ``--rounds`` rounds in rotated order, each of WARMUP steps and STEPS timed
steps (CUDA events): the step time is the median of the rounds' medians; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (reset before them), also given less what
was allocated before the step (weights, inputs). Dynamo's automatic dynamic shapes are off for the
run: flex_attention compiles a static kernel per shape (as with ``dynamic=False``).

Without CUDA the same code runs a tiny float32 model (2 layers, hidden 64, 4 / 2 heads of 16,
vocabulary 256, S=128, 128 packed tokens of 2 to 32) with sdpa, eager, flex_attention, fusedattn: a
smoke test of the CLI, not a benchmark. A system that fails is a row with its reason, never the
end of the run.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import gpu_state
from .systems import failure_note
from .timing import progress

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rope_theta=500000.0, vocab_size=128256, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=1024)

GPU_SYSTEMS = ("sdpa", "flex_attention", "fusedattn")
CPU_SYSTEMS = ("sdpa", "eager", "flex_attention", "fusedattn")
PADDED_SYSTEMS = ("sdpa", "eager")  # the systems that also get the packed row's padded batch
REFERENCE = "sdpa"
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.05}
LOGIT_SAMPLES = 256  # positions whose logits (full vocabulary) are compared


@dataclass
class Setup:
    """What a run measures: the model, the rows' lengths, the step counts."""
    config: dict
    layers: int
    dtype: torch.dtype
    device: str
    seqlens: tuple
    packed_total: int
    doc_range: tuple  # (shortest, longest) document of the packed row
    warmup: int
    steps: int
    rounds: int

    def describe(self) -> dict:
        return dict(config="Llama-3-8B-shaped" if self.config["hidden_size"] == 4096 else "tiny",
                    **{k: v for k, v in self.config.items()}, num_hidden_layers=self.layers,
                    dtype=str(self.dtype).replace("torch.", ""))


def gpu_setup(layers: int = 2, vocab: int | None = None, seqlens=None, rounds: int = 3) -> Setup:
    config = dict(LLAMA3_8B, vocab_size=vocab or LLAMA3_8B["vocab_size"])
    return Setup(config, layers, torch.bfloat16, "cuda", tuple(seqlens or (4096, 16384)), 16384, (256, 4096),
                 warmup=2, steps=10, rounds=rounds)


def cpu_setup(layers: int = 2, vocab: int | None = None, seqlens=None, rounds: int = 1) -> Setup:
    config = dict(TINY, vocab_size=vocab or TINY["vocab_size"])
    return Setup(config, layers, torch.float32, "cpu", tuple(seqlens or (128,)), 128, (2, 32),
                 warmup=1, steps=3, rounds=rounds)


def document_lengths(total: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Random lengths in [shortest, longest] that sum to ``total`` (seeded): drawn one by one, the
    last one the rest."""
    assert total >= shortest
    gen = torch.Generator().manual_seed(seed)
    lengths, rest = [], total
    while rest > longest:
        high = min(longest, rest - shortest)
        lengths.append(int(torch.randint(shortest, high + 1, (), generator=gen)))
        rest -= lengths[-1]
    return lengths + [rest]


@dataclass
class Batch:
    """One system's inputs for a row: the model's keyword arguments, and where the row's real tokens
    are among the batch's flattened (B * S) positions (``gather``; None: all of them, in order)."""
    layout: str  # "single", "padding-free" or "padded"
    inputs: dict
    real_tokens: int
    gather: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def computed_tokens(self) -> int:
        return self.inputs["input_ids"].numel()


def single_batch(seqlen: int, vocab: int, device: str, seed: int = 1) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seqlen), generator=gen).to(device)
    return Batch("single", dict(input_ids=ids, labels=ids), seqlen, extra=dict(B=1, S=seqlen))


def packed_batches(lengths: list[int], vocab: int, device: str, seed: int = 2) -> tuple[Batch, Batch]:
    """The same documents as one padding-free row (position_ids restarting per document; the first
    token of each document has no label, so no document predicts the next one's) and as a right-padded
    (documents, longest) batch with a 2-D attention mask (the pads have no label)."""
    gen = torch.Generator().manual_seed(seed)
    total, longest, docs = sum(lengths), max(lengths), len(lengths)
    ids = torch.randint(0, vocab, (total,), generator=gen)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[starts] = -100
    flat = dict(input_ids=ids[None], position_ids=positions[None], labels=labels[None])
    # padded: document i in row i, positions 0..n-1; gather maps each packed token to its padded slot
    gather = torch.cat([i * longest + torch.arange(n) for i, n in enumerate(lengths)])
    padded_ids = torch.zeros(docs * longest, dtype=ids.dtype)
    padded_ids[gather] = ids
    mask = torch.zeros(docs * longest, dtype=torch.long)
    mask[gather] = 1
    padded_labels = torch.full((docs * longest,), -100, dtype=ids.dtype)
    padded_labels[gather] = ids
    padded = dict(input_ids=padded_ids.view(docs, longest), attention_mask=mask.view(docs, longest),
                  labels=padded_labels.view(docs, longest))
    info = dict(docs=docs, longest=longest)
    on = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return (Batch("padding-free", on(flat), total, extra=dict(info, B=1, S=total)),
            Batch("padded", on(padded), total, gather.to(device), extra=dict(info, B=docs, S=longest)))


def build_model(setup: Setup, implementation: str):
    """The model, random weights from seed 0, in training mode, built on the device."""
    import transformers

    config = transformers.LlamaConfig(**setup.config, num_hidden_layers=setup.layers, use_cache=False,
                                      attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                              dtype=setup.dtype)
    return model.train()


def use(model, implementation: str) -> None:
    """Switch the model's attention to ``implementation`` (fusedattn registered with transformers first)."""
    if implementation == "fusedattn":
        from fusedattn.integrations.transformers import register

        register()
    model.set_attn_implementation(implementation)
    if model.config._attn_implementation != implementation:
        raise RuntimeError(f"transformers kept attn_implementation={model.config._attn_implementation!r}")


def training_step(model, batch: Batch):
    def step():
        loss = model(**batch.inputs).loss  # the output (its logits) dropped before backward, as a training loop does
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _checked_params(model) -> list:
    attn = model.model.layers[0].self_attn
    return [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]


def capture(model, batch: Batch, samples: torch.Tensor) -> dict:
    """One training step, keeping (on the host, float32) what the agreement check compares: the loss,
    the final hidden states of the real tokens (in packed order), their logits at ``samples`` (indices
    into the real tokens) and the gradients of layer 0's attention projections."""
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, out: seen.__setitem__("hidden", out))
    try:
        out = model(**batch.inputs)
    finally:
        hook.remove()
    hidden_size, vocab = model.config.hidden_size, model.config.vocab_size
    positions = batch.gather if batch.gather is not None else torch.arange(batch.real_tokens, device=samples.device)
    kept = dict(hidden=seen.pop("hidden").detach().reshape(-1, hidden_size)[positions].float().cpu(),
                logits=out.logits.detach().reshape(-1, vocab)[positions[samples]].float().cpu())
    loss = out.loss
    del out  # the logits freed before backward, as in the timed step
    loss.backward()
    kept.update(loss=loss.item(), grads=torch.cat([p.grad.float().reshape(-1) for p in _checked_params(model)]).cpu())
    model.zero_grad(set_to_none=True)
    return kept


def rel_diff(mine: torch.Tensor, ref: torch.Tensor) -> float:
    return ((mine - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(mine: dict, ref: dict, dtype: torch.dtype) -> dict:
    """A system's captured step against the reference's: relative differences (norm of the difference
    over the reference's norm), the largest logit difference, and whether all are within REL_TOL."""
    diffs = dict(loss_rel_diff=abs(mine["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
                 hidden_rel_diff=rel_diff(mine["hidden"], ref["hidden"]),
                 logits_rel_diff=rel_diff(mine["logits"], ref["logits"]),
                 grad_rel_diff=rel_diff(mine["grads"], ref["grads"]))
    tol = REL_TOL[dtype]
    return dict(loss=mine["loss"], ref_loss=ref["loss"], **diffs,
                logits_max_diff=(mine["logits"] - ref["logits"]).abs().max().item(), rel_tol=tol,
                output_agrees=all(math.isfinite(d) and d <= tol for d in diffs.values()))


def time_steps(step, setup: Setup) -> dict:
    """WARMUP steps, then STEPS timed ones: their times (ms; CUDA events on a GPU) and the peak memory."""
    cuda = setup.device == "cuda"
    for _ in range(setup.warmup):
        step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(setup.steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
        peak = torch.cuda.max_memory_allocated()
        return dict(times=times, peak_gb=peak / 2**30, step_peak_gb=(peak - base) / 2**30)
    for _ in range(setup.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return dict(times=times)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def rows_of(setup: Setup, systems) -> list[tuple[str, list[tuple[str, Batch]]]]:
    """(row name, [(system, its batch)]) for every row; the reference's entry first."""
    vocab = setup.config["vocab_size"]
    ordered = sorted(systems, key=lambda s: s != REFERENCE)
    rows = [(f"S={s}", [(name, single_batch(s, vocab, setup.device)) for name in ordered]) for s in setup.seqlens]
    lengths = document_lengths(setup.packed_total, *setup.doc_range)
    flat, padded = packed_batches(lengths, vocab, setup.device)
    entries = [(name, padded) for name in ordered if name in PADDED_SYSTEMS]
    entries += [(name, flat) for name in ordered]
    rows.append(("packed", entries))
    return rows


def _row(row: str, system: str, batch: Batch, setup: Setup) -> dict:
    return dict(row=row, system=system, layout=batch.layout, **batch.extra, real_tokens=batch.real_tokens,
                computed_tokens=batch.computed_tokens, layers=setup.layers, dtype=str(setup.dtype).replace("torch.", ""))


def run(setup: Setup, systems, on_row=None) -> list[dict]:
    """Every row: each system's checked first step, then the rounds (rotated order); rows saved
    through ``on_row(rows so far)`` after each row."""
    import torch._dynamo

    model = build_model(setup, "sdpa" if "sdpa" in systems else "eager")
    rows, unsupported = [], {}
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for name, entries in rows_of(setup, systems):
            rows += run_row(model, name, entries, setup, unsupported)
            _free(setup.device)
            if on_row:
                on_row(rows)
    return rows


def run_row(model, name: str, entries, setup: Setup, unsupported: dict) -> list[dict]:
    """One row: agreement (and compilation) first, then ``setup.rounds`` timed rounds in rotated order.
    ``unsupported``: system -> the note of a NotImplementedError on an earlier row (skipped here)."""
    out = [_row(name, system, batch, setup) for system, batch in entries]
    gen = torch.Generator().manual_seed(3)
    samples = torch.randperm(entries[0][1].real_tokens, generator=gen)[:LOGIT_SAMPLES].sort().values.to(setup.device)
    reference, indices = None, []
    for i, ((system, batch), row) in enumerate(zip(entries, out)):
        if system in unsupported:
            row["note"] = f"skipped: {unsupported[system]}"
            continue
        try:
            use(model, system)
            kept = capture(model, batch, samples)
        except Exception as e:  # a system failing is a result, not the end of the run
            row["note"] = failure_note(e)
            if isinstance(e, NotImplementedError):
                unsupported[system] = f"{row['note']} (on row {name})"
            model.zero_grad(set_to_none=True)
            _free(setup.device)
            continue
        if reference is None:
            reference = (f"{system} ({batch.layout})", kept)
            row.update(reference=reference[0], loss=kept["loss"])
        else:
            row.update(reference=reference[0], **compare(kept, reference[1], setup.dtype))
        indices.append(i)
        del kept
    measured = {i: [] for i in indices}
    turn = lambda r: r % max(len(indices), 1)  # noqa: E731  round r starts with the r-th system
    work = [i for r in range(setup.rounds) for i in indices[turn(r):] + indices[:turn(r)]]
    for i in progress(work, f"hf {name}"):
        system, batch = entries[i]
        if "note" in out[i]:
            continue  # failed in an earlier round
        try:
            use(model, system)
            measured[i].append(time_steps(training_step(model, batch), setup))
            if setup.device == "cuda":
                out[i].setdefault("gpu_state_rounds", []).append(gpu_state.query())
        except Exception as e:  # noqa: BLE001
            out[i]["note"] = failure_note(e)
            model.zero_grad(set_to_none=True)
        _free(setup.device)
    for i in indices:
        if "note" not in out[i]:
            out[i].update(merge(measured[i], out[i]["real_tokens"], setup))
    return out


def merge(rounds: list[dict], real_tokens: int, setup: Setup) -> dict:
    medians = [statistics.median(r["times"]) for r in rounds]
    step_ms = statistics.median(medians)
    merged = dict(rounds=len(rounds), steps_per_round=setup.steps, warmup_steps=setup.warmup, step_ms=step_ms,
                  step_ms_rounds=medians, tokens_per_s=real_tokens / step_ms * 1e3)
    if all("peak_gb" in r for r in rounds):
        merged.update(peak_gb=max(r["peak_gb"] for r in rounds), step_peak_gb=max(r["step_peak_gb"] for r in rounds))
    return merged


def table(rows: list[dict]) -> str:
    """Step time, real tokens/s, peak memory, fusedattn's tokens/s over each (> 1: ours is faster;
    padding-free fusedattn on the packed row), and the differences from the reference."""
    lines = [f"{'row':<9}{'system':<16}{'layout':<14}{'step ms':>9}{'tokens/s':>11}{'peak GB':>9}{'step GB':>9}"
             f"{'ours/this':>11}{'hidden':>10}{'logits':>10}{'grad':>10}  (rel. diff vs reference)"]
    ours = {r["row"]: r for r in rows if r["system"] == "fusedattn" and "step_ms" in r}
    for r in rows:
        head = f"{r['row']:<9}{r['system']:<16}{r['layout']:<14}"
        if "step_ms" not in r:
            lines.append(f"{head}  {r.get('note', '')}")
            continue
        mine = ours.get(r["row"])
        ratio = f"{mine['tokens_per_s'] / r['tokens_per_s']:.2f}x" if mine and mine is not r else ""
        diffs = "".join(f"{r[k]:>10.2e}" if k in r else f"{'ref' if k == 'hidden_rel_diff' else '':>10}"
                        for k in ("hidden_rel_diff", "logits_rel_diff", "grad_rel_diff"))
        peak = f"{r['peak_gb']:>9.2f}{r['step_peak_gb']:>9.2f}" if "peak_gb" in r else f"{'-':>9}{'-':>9}"
        line = f"{head}{r['step_ms']:>9.1f}{r['tokens_per_s']:>11.0f}{peak}{ratio:>11}{diffs}"
        if not r.get("output_agrees", True):
            line += f"  OUTPUT DIFFERS from {r['reference']}'s (rel. tol {r['rel_tol']:g})"
        lines.append(line.rstrip())
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Bars of real tokens/s and of peak memory, per system and layout, grouped by row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if "tokens_per_s" in r]
    if not timed:
        return False
    names = list(dict.fromkeys(r["row"] for r in timed))
    label_of = lambda r: r["system"] if r["layout"] == "single" else f"{r['system']} ({r['layout']})"  # noqa: E731
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(map(label_of, timed)))}
    panels = [("tokens_per_s", "real tokens / s")] + ([("peak_gb", "peak memory (GB)")]
                                                     if any("peak_gb" in r for r in timed) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    width = 0.8 / max(sum(r["row"] == name for r in timed) for name in names)
    for ax, (key, ylabel) in zip(axes[0], panels):
        seen = set()
        for x, name in enumerate(names):
            bars = [r for r in timed if r["row"] == name and key in r]
            for j, r in enumerate(bars):  # the row's bars side by side, centred on its tick
                label = label_of(r)
                ax.bar(x + (j - (len(bars) - 1) / 2) * width, r[key], width, color=colors[label],
                       label=None if label in seen else label,
                       edgecolor="black" if r["system"] == "fusedattn" else None)
                seen.add(label)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(top=1.4 * max(r[key] for r in timed if key in r))  # room for the legend above the bars
    axes[0][0].legend(fontsize=7, ncol=2, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args, env: dict, stem: str) -> list[dict]:
    """``python -m fusedattn.bench --hf``: the rows on the GPU (or the tiny model on the CPU), the JSON
    ``<out>/<stem>.json`` saved after each row, the table, the plot."""
    import transformers

    on_gpu = torch.cuda.is_available()
    ints = lambda text: tuple(int(x) for x in text.split(",")) if text else None  # noqa: E731
    make = gpu_setup if on_gpu else cpu_setup
    setup = make(layers=args.hf_layers, vocab=args.hf_vocab, seqlens=ints(args.seqlens),
                 **(dict(rounds=args.rounds) if args.rounds else {}))
    systems = tuple(args.systems.split(",")) if args.systems else (GPU_SYSTEMS if on_gpu else CPU_SYSTEMS)
    env = dict(env, transformers=transformers.__version__, rounds=setup.rounds)
    model_info = setup.describe()
    lengths = document_lengths(setup.packed_total, *setup.doc_range)
    print(f"fusedattn --hf on {env['device']} (torch {env['torch']}, transformers {env['transformers']}): "
          f"{'Llama-3-8B-shaped' if on_gpu else 'tiny'} model, {setup.layers} layers, vocabulary "
          f"{setup.config['vocab_size']}, {model_info['dtype']}; systems {', '.join(systems)}; "
          f"packed row: {len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)}")
    out_dir = Path(args.out)
    json_path = out_dir / f"{stem}.json"
    step = ("forward with labels (transformers' loss) + backward; gradients set to None after each step; "
            "no optimizer step")

    def save(rows):
        if not args.no_save:
            out_dir.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(dict(
                environment=env, model=model_info, step=step, warmup_steps=setup.warmup,
                steps_per_round=setup.steps, reference=REFERENCE, rel_tol=REL_TOL[setup.dtype],
                packed=dict(lengths=lengths, total=sum(lengths), range=list(setup.doc_range)),
                systems=list(systems), rows=rows), indent=1))

    rows = run(setup, systems, on_row=save)
    print(table(rows))
    if not args.no_save:
        print(f"wrote {json_path}")
        title = (f"{env['device']}: Llama-3-8B-shaped x{setup.layers} layers, training step, "
                 f"{model_info['dtype']}" if on_gpu else f"{env['device']}: tiny model (smoke test)")
        if plot(rows, out_dir / f"{stem}.png", title):
            print(f"wrote {out_dir / f'{stem}.png'}")
    return rows
