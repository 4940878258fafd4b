"""Layer 2, stable-baselines3 files: controller zips and replay buffers read without running code from them."""
