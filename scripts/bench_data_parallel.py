"""Data-parallel request assignment: engine steps to drain a skewed workload.

Runs the real engine (DataParallelEngine over LLMEngine replicas) and counts
steps, not seconds (so the CPU it runs on does not matter): a step of the data-parallel engine steps every busy
replica once (concurrently), so the number of steps until every request
finishes is the makespan in units of one engine step, a hardware-independent
measure of how well the assignment policy balances the replicas. Compares
our policy (fewest outstanding steps, engine/data_parallel.py) with
fewest outstanding tokens, round-robin and fewest unfinished requests, on
the same requests.

Run (CPU, virtual devices):
XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_data_parallel.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.data_parallel import DataParallelEngine

    llm = LLM(args.model, progress=False, tensor_parallel_size=1, data_parallel_size=args.replicas,
              max_model_len=512, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.wait_compiled()  # every bucket compiled before any timing
    engine: DataParallelEngine = llm.engine
    vocab = llm.model.config.vocab_size
    counter = {"n": 0}

    policies = {
        "fewest outstanding steps (ours)": DataParallelEngine.choose_replica,
        "fewest outstanding tokens": lambda self, *_: int(np.argmin([sum(r.outstanding_tokens())
                                                                     for r in self.replicas])),
        "round-robin": lambda self, *_: counter.__setitem__("n", counter["n"] + 1) or counter["n"] % len(self.replicas),
        "fewest requests": lambda self, *_: int(np.argmin([len(r.requests) for r in self.replicas])),
    }
    results = {name: [] for name in policies}
    for trial in range(args.trials):
        rng = np.random.default_rng(trial)
        # Heavy-tailed lengths: most requests short, a few 10-20x longer (chat-like traffic).
        prompt_lens = np.clip(rng.lognormal(3.0, 1.0, args.num_prompts), 4, 300).astype(int)
        output_lens = np.clip(rng.lognormal(2.5, 1.0, args.num_prompts), 2, 200).astype(int)
        requests = [(rng.integers(0, vocab, int(p)).tolist(),
                     SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True))
                    for p, o in zip(prompt_lens, output_lens)]
        for name, policy in policies.items():
            engine.choose_replica = policy.__get__(engine)
            for i, (prompt, params) in enumerate(requests):
                engine.add_request(f"{name}-{trial}-{i}", prompt, params)
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
            results[name].append(steps)
    work = {name: {"steps_per_trial": v, "mean_steps": statistics.mean(v)} for name, v in results.items()}
    best = work["fewest outstanding steps (ours)"]["mean_steps"]
    print(f"{args.replicas} replicas, {args.num_prompts} requests per trial, {args.trials} trials: "
          f"data-parallel engine steps to drain (fewer is better)")
    for name, w in work.items():
        print(f"  {name:<31} mean {w['mean_steps']:.1f} steps ({w['mean_steps'] / best:.2f}x)  {w['steps_per_trial']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "policies": work}, f, indent=2)


if __name__ == "__main__":
    main()
