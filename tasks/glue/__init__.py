"""GLUE finetuning (MNLI, QQP) of a BERT with a classification head."""
