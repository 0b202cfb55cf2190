"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_int_id identifies the adapter (>= 1; 0 is "no adapter" in the
    engine's slot index): requests naming the same id share one loaded copy
    and one prefix-cache namespace. lora_path: a PEFT directory
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int >= 1, "
                             f"got {self.lora_int_id!r}")
