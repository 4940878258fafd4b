"""LightningDataModules and data generators of clova-train (installed as ``clova_train.datamodules``)."""

from clova_train.datamodules.chunks import PendingChunks
from clova_train.datamodules.concept_folders import ConceptFolderDataModule, SyntheticConceptDataModule
from clova_train.datamodules.tool_instructions import SyntheticToolDataModule, ToolInstructionDataModule

__all__ = [
    "ConceptFolderDataModule",
    "PendingChunks",
    "SyntheticConceptDataModule",
    "SyntheticToolDataModule",
    "ToolInstructionDataModule",
]
