"""A frozen depth-estimation tool: HYDRA's and ViperGPT's ``ImagePatch.compute_depth`` (the median depth of a patch).

Not a prompt tool (no recipe, nothing learned): a transformers depth-estimation model loaded from a directory or hub
id (``estimator``), its request format (``request``) and a tiny random-weight model of a real architecture for tests
and offline runs (``tiny``). ``clova-train serve <model dir>`` serves it at ``POST /v1/depth``.
"""

from clova_train.tools.depth.estimator import DepthEstimator, check_depth_model_dir, depth_model_type

__all__ = ["DepthEstimator", "check_depth_model_dir", "depth_model_type"]
