"""LoRA adapters: the request type, PEFT loading and the device slots
(see slots.py for how several adapters share one compiled step)."""
