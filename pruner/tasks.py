"""`pruner.tasks.jsonl_dataset`: the name task YAMLs written before pruner's subpackages use
(`custom_dataset: !function pruner.tasks.jsonl_dataset`). New YAMLs name
`pruner.evaluation.tasks.jsonl_dataset`; this alias keeps the old ones working."""

from pruner.evaluation.tasks import jsonl_dataset

__all__ = ["jsonl_dataset"]
