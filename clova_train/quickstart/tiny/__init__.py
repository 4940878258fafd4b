"""clova_train/quickstart/tiny."""
