"""Gymnasium environments of clova-train (installed as ``clova_train.envs``); the HYDRA loop lands here."""
