"""LoRA adapters served beside the base model (upstream's --enable-lora): docs/lora.md.

`lora_config` reads PEFT adapters, `lora_layers` holds a target linear's slots and its delta,
`lora_manager` the model side (targets, adapters in each rank's layout, slot copies), `lora_registry`
the tokenizer side (names, ids, the load and unload routes' bodies). The scheduler's rules:
`managers/scheduler_components/lora_slots.py`.
"""
