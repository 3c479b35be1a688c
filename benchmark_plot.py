"""Bar chart of saved bench.py results: HF transformers vs nanovllm output tokens/s, run by run.

Reads one or more files of bench.py results: what `--json-out` writes (one JSON object), a list
of such objects, or JSON lines (one run per line, e.g. bench.py's last stdout lines collected).
Each run gets a panel with its own y-axis (a tiny model and a 0.6B one differ a thousandfold),
labelled with device, model, dtype, workload, HF batching and date, and the nanovllm / HF ratio
written over the bars. A run made without --compare-hf shows the nanovllm bar alone.

Usage: python benchmark_plot.py docs/bench/*.json [--out docs/benchmark.png]
"""
import argparse
import json
import os

REQUIRED_KEYS = ("device", "device_name", "model", "dtype", "num_seqs", "input_len_range", "output_len_range",
                 "throughput_tok_s", "date")
HF_COLOR, NANOVLLM_COLOR = "#9e9e9e", "#1f77b4"
PANEL_WIDTH_IN, FIGURE_HEIGHT_IN = 4.6, 5.6  # wide enough for the three label lines under each panel
HEADROOM = 1.3  # y-axis top as a multiple of the tallest bar: room for the value labels and the ratio


def load_runs(path: str) -> list[dict]:
    """The bench.py results in `path`: one JSON object, a JSON list of them, or JSON lines."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error.msg}); expected one JSON object, "
                                 "a JSON list or JSON lines as bench.py writes them") from None
    runs = data if isinstance(data, list) else [data]
    if not runs:
        raise ValueError(f"{path} holds no bench.py results")
    for index, run in enumerate(runs):
        missing = [key for key in REQUIRED_KEYS if not isinstance(run, dict) or key not in run]
        if missing:
            raise ValueError(f"{path} run {index} lacks {missing}; is it a bench.py result?")
    return runs


def _range(values: list[int]) -> str:
    return f"{values[0]}..{values[1]}"


def run_label(run: dict) -> str:
    """The lines under a panel: device, workload, HF batching, date."""
    lines = [
        f"{run['device']}: {run['device_name']}",
        (f"{run['num_seqs']} seqs, input {_range(run['input_len_range'])}, "
         f"output {_range(run['output_len_range'])} tokens"),
    ]
    if "hf_throughput_tok_s" in run:
        lines.append(f"HF: <= {run['hf_batch_size']} seqs per generate, {run['hf_cache']} KV cache")
    lines.append(f"{run['date']}, host load {run['host_load_1m']}" if "host_load_1m" in run else run["date"])
    return "\n".join(lines)


def plot(runs: list[dict], out: str) -> None:
    # Imported only to draw, after the inputs are checked: matplotlib is an optional extra (`bench`),
    # absent from some machines that run bench.py.
    import matplotlib
    matplotlib.use("Agg")  # writes files only; never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(PANEL_WIDTH_IN * len(runs), FIGURE_HEIGHT_IN), squeeze=False)
    for ax, run in zip(axes[0], runs):
        names, values, colors = [], [], []
        if "hf_throughput_tok_s" in run:
            names.append("HF transformers\ngenerate")
            values.append(run["hf_throughput_tok_s"])
            colors.append(HF_COLOR)
        names.append("nanovllm")
        values.append(run["throughput_tok_s"])
        colors.append(NANOVLLM_COLOR)
        bars = ax.bar(names, values, color=colors, width=0.6)
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=3)
        top = max(values) * HEADROOM
        ax.set_ylim(0, top)
        if "speedup_vs_hf" in run:
            ax.text(0.5, 0.93, f"nanovllm / HF = {run['speedup_vs_hf']:.2f}x", transform=ax.transAxes,
                    ha="center", va="top", fontsize=12, fontweight="bold")
        ax.set_title(f"{run['model']}, {run['dtype']}", fontsize=11)
        ax.set_xlabel(run_label(run), fontsize=8.5)
        ax.set_ylabel("output tokens / s (higher is better)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.suptitle("Offline generation throughput: nanovllm vs HuggingFace transformers, same prompts and output "
                 "lengths", fontsize=12)
    fig.tight_layout()
    out_dir = os.path.dirname(out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="bench.py result files (--json-out or JSON lines)")
    parser.add_argument("--out", default="docs/benchmark.png", help="PNG to write (default docs/benchmark.png)")
    args = parser.parse_args()
    runs = [run for path in args.files for run in load_runs(path)]
    plot(runs, args.out)
    print(f"wrote {args.out}: {len(runs)} run(s)")


if __name__ == "__main__":
    main()
