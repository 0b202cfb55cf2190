"""The numbers of a scripts/gpu_check.sh run, from its JSON files, as the
first lines of its summary: the default context (what a user who sets no
option meets) first, the 4k context beside it, then start-up and the rest."""

import json
import sys
from pathlib import Path

# (label, JSON name) of the e2e runs, in the order their lines come.
RUNS = (("default context", "e2e_default"), ("4k context", "e2e_4k"), ("before (xla backend, scan, 4k)", "e2e_before"))


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:  # cut short while writing
        return None


def _batches(run: dict, prefix: str) -> list[str]:
    return sorted((k for k in run if k.startswith(prefix)), key=lambda k: int(k[len(prefix):]))


def step_lines(label: str, run: dict) -> list[str]:
    lines = []
    for key in _batches(run, "latency_b"):
        lat = run[key]
        lines.append(f"{label} batch {lat['batch_size']:>3}: step {lat['decode_step_ms_median']:.2f} ms median "
                     f"(mean {lat['decode_step_ms_mean']:.2f}), device alone {lat['device_step_ms']:.2f} ms, "
                     f"host share {lat['host_share_of_step_time']:.1%}, {lat['decode_tokens_per_s']:.0f} tok/s, "
                     f"{lat['step_over_weight_read']:.2f}x the weight read")
    if "median_host_share" in run:
        lines.append(f"{label}: median host share over the batches {run['median_host_share']:.1%}")
    return lines


def compiled_lines(label: str, run: dict) -> list[str]:
    lines = []
    for key in _batches(run, "compiled_b"):
        report = run[key]
        if "error" in report:
            lines.append(f"{label} compiled decode step {key[10:]}: not read ({report['error']})")
            continue
        counts = report["kernel_counts"]
        kinds = ", ".join(f"{op} {n}" for op, n in counts.items())
        copies = report["weight_copies"]
        lines.append(f"{label} compiled decode step (bucket {report['bucket']}): {report['kernels_per_layer']:.1f} "
                     f"kernels per layer; attention output buffers {report['attention_bytes_written'] / 2**20:.1f} MiB "
                     f"per step (at most what it writes); weight copies/concatenates {copies}"
                     + (f" (first: {report['weight_copy_lines'][0]})" if copies else "")
                     + f"; XLA's bytes accessed {report['xla_bytes_accessed'] / 1e9:.2f} GB")
        if key == _batches(run, "compiled_b")[0]:
            lines.append(f"{label}   kernels of the bucket-{report['bucket']} step: {kinds}")
    return lines


def run_lines(label: str, run: dict) -> list[str]:
    lines = [f"{label}: max_model_len {run.get('max_model_len')}, {run.get('num_kv_blocks')} KV blocks"]
    lines += step_lines(label, run)
    if "long_context" in run:
        long = run["long_context"]
        first = long.get("time_to_first_token_s")
        lines.append(f"{label} one {long['input_len']}-token request: first token "
                     f"{'-' if first is None else f'{first:.2f}'} s (its prompt steps' host time "
                     f"{long['prefill_s']:.2f} s), step "
                     f"{long['decode_step_ms_median']:.2f} ms median, device alone {long['device_step_ms']:.2f} ms, "
                     f"host share {long['host_share_of_step_time']:.1%}")
    lines += compiled_lines(label, run)
    if "throughput" in run:
        t = run["throughput"]
        lines.append(f"{label} offline {t['num_requests']} requests (256 in, 128 out, range ratio 0.5): {t['output_tokens_per_s']:.0f} "
                     f"output tok/s, host share {t['host_share_of_step_time']:.1%}, "
                     f"{t['num_preemptions']} preemptions")
    if run.get("skipped"):
        lines.append(f"{label}: skipped: {', '.join(run['skipped'])}")
    return lines


def main():
    out = Path(sys.argv[1])
    runs = {name: load(out, name) for _, name in RUNS}
    lines = []
    for label, name in RUNS:
        if runs[name] is not None:
            lines += run_lines(label, runs[name])
    for label, name in RUNS:
        run = runs[name]
        if run is not None and "ready_s" in run:
            loaded = run["programs_loaded"]
            kind = "cold" if not loaded else "warm" if loaded == run["programs"] else "partly cached"
            first_token = f", first token {run['first_token_s']:.1f} s" if "first_token_s" in run else ""
            lines.append(f"{label} start ({kind}): serving {run['ready_s']:.1f} s{first_token}, every program compiled"
                         f" {run['compiled_s']:.1f} s ({run['programs']} programs, "
                         f"{run['programs_loaded']} loaded from the executable cache, "
                         f"{run.get('programs_compiled_while_loading', 0)} compiled while the weights loaded in "
                         f"{run.get('load_s', float('nan')):.1f} s)")
    warm = load(out, "e2e_default_warm")
    if warm is not None:
        first_token = f", first token {warm['first_token_s']:.1f} s" if "first_token_s" in warm else ""
        lines.append(f"default context warm start: serving {warm['ready_s']:.1f} s{first_token}, every program "
                     f"{warm['compiled_s']:.1f} s ({warm['programs_loaded']} of {warm['programs']} programs loaded "
                     f"from the executable cache)")
    first = next((run for run in runs.values() if run and "copy_GBps" in run), None)
    if first is not None:
        lines.append(f"device: {first['devices']}, jax {first['jax']}, copy {first['copy_GBps']:.0f} GB/s, weights "
                     f"{first.get('weight_bytes', 0) / 1e9:.2f} GB read in {first.get('weight_read_ms', 0):.2f} ms")
    after, before = runs["e2e_4k"], runs["e2e_before"]
    if after and before:
        for key in (k for k in _batches(after, "latency_b") if k in before):
            ratio = before[key]["decode_step_ms_mean"] / after[key]["decode_step_ms_mean"]
            lines.append(f"speed-up {key[8:]} at 4k: {ratio:.2f}x (before / after step time, same run)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
