"""Random PEFT adapters and a mixed-adapter forward, shared by
tests/api/test_lora.py, the tensor-parallel LoRA check (tests/parallel_checks.py)
and the server test: written with peft's own save_pretrained so that the
files are what PEFT users hand us."""

from __future__ import annotations

import copy

import numpy as np
import peft
import torch


def make_adapter(base, directory, seed, **options):
    """A random PEFT adapter of `base` saved to `directory`; B scaled up so
    that the adapter moves the logits far beyond the parity tolerance
    (init_lora_weights=False alone gives B values too small to tell)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    model.save_pretrained(str(directory))
    return str(directory)


def peft_model(base, directory):
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), directory).eval()


def last_row_logits(llm, prompts, lora_ids):
    """One mixed forward of the engine's runner over `prompts` (sequence i
    with adapter lora_ids[i], 0 = none; each registered already): the
    logits of each last row."""
    engine = llm.engine
    slots = [engine.lora.acquire(i) if i else 0 for i in lora_ids]
    tables = []
    for k, prompt in enumerate(prompts):
        engine.block_manager.allocate_prefix(("parity", k), [])
        assert engine.block_manager.allocate(("parity", k), len(prompt))
        tables.append(engine.block_manager.block_table(("parity", k)))
    try:
        inputs = engine.runner.inputs(prompts, [0] * len(prompts), [len(p) for p in prompts], tables,
                                      seq_lora_slots=slots)
        logits, _ = engine.runner.forward(inputs)
        return np.asarray(logits)[: len(prompts)]
    finally:
        for k in range(len(prompts)):
            engine.block_manager.free(("parity", k))
        for slot in slots:
            if slot:
                engine.lora.release(slot)
