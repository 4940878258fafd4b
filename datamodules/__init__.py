"""LightningDataModules and data generators of clova-train (installed as ``clova_train.datamodules``)."""

from clova_train.datamodules.prompt_tuning.chunks import PendingChunks, PromptTuningDataModule
from clova_train.datamodules.prompt_tuning.grounding import GroundingDataModule, SyntheticGroundingDataModule
from clova_train.datamodules.prompt_tuning.concept_folders import ConceptFolderDataModule, SyntheticConceptDataModule
from clova_train.datamodules.prompt_tuning.masked_concepts import MaskedConceptDataModule, SyntheticMaskedConceptDataModule
from clova_train.datamodules.tool_llm.tool_instructions import SyntheticToolDataModule, ToolInstructionDataModule
from clova_train.datamodules.prompt_tuning.vqa_records import SyntheticVqaDataModule, VqaRecordDataModule

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
