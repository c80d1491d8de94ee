"""SQuAD 1.1 / 2.0 finetuning with the standard BERT recipe (Google's ``run_squad.py``).

Megatron-LM never shipped SQuAD; the pieces here follow Google's recipe step for step:

* :mod:`tasks.squad.reader`: the SQuAD JSON -> examples (whitespace-split document words with
  character -> word offsets; answers checked against the context).
* :mod:`tasks.squad.features`: examples -> ``[CLS] query [SEP] doc-span [SEP]`` features
  (WordPiece, document stride, max query length, max-context flags, span labels).
* :mod:`tasks.squad.postprocess`: start/end logits -> n-best answers -> ``predictions.json``
  (and ``null_odds.json`` for 2.0).
* :mod:`tasks.squad.metric`: the official ``evaluate-v1.1.py`` / ``evaluate-v2.0.py`` scores.
* :mod:`tasks.squad.model` and :mod:`tasks.squad.finetune`: the span model's provider and loss
  (the head itself is :class:`megatron.core.models.bert_heads.QuestionAnswering`) and the
  ``tasks/main.py --task SQUAD`` runner.

The library modules (reader, features, postprocess, metric) need no model and no process group.
"""
