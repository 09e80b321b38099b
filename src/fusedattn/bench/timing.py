"""Timing helpers shared by the bench's entry point and its row modules (variants, packed, decode).

Eager medians (``median_ms``), CUDA-graph captures and their replay medians (``capture_graph``,
``graph_ms``) and the progress bar (``progress``). They live here, not in ``__main__``, so that the
row modules need not import the entry point that imports them.
"""

from __future__ import annotations

import time

import torch


def progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="run", dynamic_ncols=True)
    except ImportError:
        return items


def median_ms(fn, grad_to_none=None) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    fn()  # warm up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
    return sorted(times)[len(times) // 2]


def capture_graph(step, warmups: int = 3, before_each=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``step``, captured after ``warmups`` calls on a side stream (as
    torch.cuda.graphs asks: compilation and allocator warm-up stay out of the graph);
    ``before_each`` runs before every warm-up call and before the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            if before_each:
                before_each()
            step()
    torch.cuda.current_stream().wait_stream(side)
    if before_each:
        before_each()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_ms(step, grad_to_none=None) -> float:
    """Median time of replays of a CUDA graph of ``step`` (captured after warm-up on a side stream,
    as torch.cuda.graphs asks): the GPU's time for the step, without the host's launch time."""
    def clear_grads():
        for t in grad_to_none or ():
            t.grad = None

    # gradients cleared before the capture: captured as fresh tensors in the graph's pool, rewritten by each replay
    graph = capture_graph(step, before_each=clear_grads)
    try:
        return median_ms(graph.replay)
    finally:
        clear_grads()
        del graph
