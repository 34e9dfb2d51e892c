"""tandem_trainer: RL fine-tuning of LLMs with LoRA (trainer side)."""
