"""clova_train/quickstart/demos."""
