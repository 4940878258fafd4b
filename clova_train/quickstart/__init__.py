"""clova_train/quickstart."""
