"""The bundled demo: a synthetic image-grounded task family, a tiny Qwen2.5-VL trained on it, and its drafter."""
