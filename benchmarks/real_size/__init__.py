"""Real-size models and the smoke run's probes: benchmark scaffolding, imported with ``benchmarks/`` on the path."""


def model_folder(model: str) -> str:
    """The folder a real-size model is built in under the models directory: its :data:`~real_size.models.REAL_SIZES`
    name, or a plug-in builder's ``"module:function"`` written ``module.function``."""
    return model.replace(":", ".")
