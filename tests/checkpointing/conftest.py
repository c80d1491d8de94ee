"""The end-to-end corpus fixture of tests/training, for the checkpoints saved here."""

from tests.training.conftest import gpt2_corpus  # noqa: F401 - a fixture, used by name
