"""LightningDataModules and data generators of clova-train (installed as ``clova_train.datamodules``)."""

from clova_train.datamodules.chunks import PendingChunks, PromptTuningDataModule
from clova_train.datamodules.grounding import GroundingDataModule, SyntheticGroundingDataModule
from clova_train.datamodules.concept_folders import ConceptFolderDataModule, SyntheticConceptDataModule
from clova_train.datamodules.masked_concepts import MaskedConceptDataModule, SyntheticMaskedConceptDataModule
from clova_train.datamodules.tool_instructions import SyntheticToolDataModule, ToolInstructionDataModule
from clova_train.datamodules.vqa_records import SyntheticVqaDataModule, VqaRecordDataModule

__all__ = [
    "ConceptFolderDataModule",
    "GroundingDataModule",
    "MaskedConceptDataModule",
    "PendingChunks",
    "PromptTuningDataModule",
    "SyntheticConceptDataModule",
    "SyntheticGroundingDataModule",
    "SyntheticMaskedConceptDataModule",
    "SyntheticToolDataModule",
    "SyntheticVqaDataModule",
    "ToolInstructionDataModule",
    "VqaRecordDataModule",
]
