"""Key metrics of ncu raw pages side by side (one kernel a page: the first launch in each file):
time, SM active cycles (min / average / max: how evenly the SMs end), tensor-pipe activity,
instructions, occupancy and the warp stall reasons (per issued instruction, those above 0.05).

    ncu --clock-control none -k regex:_attn_fwd -c 1 --launch-skip 1 --section WarpStateStats \\
        --section SpeedOfLight --section LaunchStats -o ours python ...
    ncu -i ours.ncu-rep --page raw --csv > ours-raw.csv
    python benchmarks/ncu_metrics.py ours-raw.csv fa4-raw.csv
"""
import csv
import re
import sys

METRICS = re.compile(
    r"^(gpu__time_duration.sum|gpc__cycles_elapsed.max|sm__cycles_active\.(min|avg|max)|smsp__inst_executed.sum|"
    r"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active|"
    r"sm__throughput.avg.pct_of_peak_sustained_elapsed|sm__warps_active.avg.pct_of_peak_sustained_active|"
    r"launch__grid_size|launch__registers_per_thread|"
    r"smsp__average_warps_issue_stalled_.*_per_issue_active.ratio)$")


def first_kernel(path: str) -> dict[str, str]:
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, values = rows[header], rows[header + 2]  # the row after the names holds the units
    return {n: v for n, v in zip(names, values) if METRICS.match(n)}


def main() -> None:
    pages = {path.rsplit("/", 1)[-1][:28]: first_kernel(path) for path in sys.argv[1:]}
    print("metric".ljust(70), *[name.ljust(28) for name in pages])
    for metric in sorted(set().union(*pages.values())):
        values = [page.get(metric, "-") for page in pages.values()]
        if "stalled" in metric and all(v == "-" or float(v.replace(",", "")) < 0.05 for v in values):
            continue
        print(metric[:70].ljust(70), *[v.ljust(28) for v in values])


if __name__ == "__main__":
    main()
