"""The numbers of a scripts/gpu_check.sh run, from its JSON files, as lines of its summary."""

import json
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def latency_lines(label: str, run: dict) -> list[str]:
    lines = []
    for key in sorted((k for k in run if k.startswith("latency_b")), key=lambda k: int(k[9:])):
        lat = run[key]
        lines.append(f"{label} batch {lat['batch_size']:>3}: decode step {lat['decode_step_ms_mean']:.2f} ms "
                     f"(median {lat.get('decode_step_ms_median', float('nan')):.2f}), "
                     f"{lat['decode_tokens_per_s']:.0f} tok/s, {lat['step_over_weight_read']:.2f}x the weight read, "
                     f"device alone {lat['device_step_ms']:.2f} ms, host share {lat['host_share_of_step_time']:.1%}")
    return lines


def main():
    out = Path(sys.argv[1])
    cold, warm, before = load(out, "e2e_cold"), load(out, "e2e_warm"), load(out, "e2e_before")
    lines = []
    for label, run in (("after (gpu backend)", cold), ("before (xla backend, scan)", before)):
        if run is None:
            continue
        if "copy_GBps" in run:
            lines.append(f"{label}: {run['devices']}, jax {run['jax']}, copy {run['copy_GBps']:.0f} GB/s, weights "
                         f"{run['weight_bytes'] / 1e9:.2f} GB read in {run['weight_read_ms']:.2f} ms")
        lines.append(f"{label}: start to serving {run['ready_s']:.1f} s, to every program compiled "
                     f"{run['compiled_s']:.1f} s ({run['programs']} programs)")
        lines += latency_lines(label, run)
        if "throughput_256x256x128" in run:
            t = run["throughput_256x256x128"]
            lines.append(f"{label} throughput 256 x (256 in, 128 out): {t['output_tokens_per_s']:.0f} output tok/s, "
                         f"host share {t['host_share_of_step_time']:.1%}")
    if warm is not None:
        lines.append(f"warm start: serving {warm['ready_s']:.1f} s, every program {warm['compiled_s']:.1f} s "
                     f"({warm['programs_loaded']} of {warm['programs']} programs loaded from the executable cache)")
    if cold and before:
        for key in (k for k in cold if k.startswith("latency_b") and k in before):
            ratio = before[key]["decode_step_ms_mean"] / cold[key]["decode_step_ms_mean"]
            lines.append(f"speed-up {key[8:]}: {ratio:.2f}x (before / after step time, same run)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
