"""encdis: Qwen2.5-VL serving with the vision encoder on its own nodes."""

__version__ = "0.1.0"
