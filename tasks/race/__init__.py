"""RACE finetuning of a BERT with a multiple-choice head."""
