"""transformers' own model tests, bound to tiny models: the conformance run's transformers part.

transformers' source distribution ships only the common mixins of its test suite (`tests/*.py`), not the
per-model test files (`tests/models/...`) that bind them to a model, nor two modules the mixins import
(`tests/exporters/test_export.py`, `tests/generation/test_utils.py`). So this file does what a per-model
file does: it binds `ModelTesterMixin` (every test body is transformers' own, from the sdist at the
installed version) to a few architectures with small configs built here, as the per-model files do. The
two missing mixins are stood in for by empty classes, so their tests (torch.export, `generate`) are not
part of the run; everything else of `ModelTesterMixin` runs unchanged.

This file is passed to pytest by `tests/conformance/run.py` with the unpacked transformers tree
(`.conformance-cache/transformers-<version>`) as the root directory, so `tests` below is transformers'.
"""

from __future__ import annotations

import sys
import types
import unittest

import tests  # transformers' tests/ from its sdist (run.py puts its root on sys.path)


def _stand_in(name: str, **attributes: object) -> None:
    """An empty module for a test module the sdist lacks, so that the mixins that import it load."""
    package, _, _ = name.rpartition(".")
    if package not in sys.modules:
        sys.modules[package] = types.ModuleType(package)
        sys.modules[package].__path__ = []  # type: ignore[attr-defined]
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


class ExportTesterMixin:  # stands in for tests/exporters/test_export.py (not in the sdist)
    pass


class GenerationTesterMixin:  # stands in for tests/generation/test_utils.py (not in the sdist)
    pass


_stand_in("tests.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
_stand_in("tests.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)

import torch  # noqa: E402
import transformers  # noqa: E402
from tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402
from transformers.testing_utils import torch_device  # noqa: E402

assert tests.__file__  # the import above is transformers' tests package, not ours


class TinyModelTester:
    """What the per-model testers of transformers provide, for a decoder or encoder of text."""

    batch_size = 2
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 37
    num_choices = 4
    num_labels = 3

    def __init__(self, parent: unittest.TestCase, config_class: type, **config: object) -> None:
        self.parent = parent
        self.config_class = config_class
        self.config = config

    def get_config(self) -> transformers.PretrainedConfig:
        names = self.config_class.attribute_map
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
        }
        reverse = {standard: own for own, standard in names.items()}
        kwargs = {reverse.get(name, name): value for name, value in sizes.items()}
        kwargs.update(self.config)
        return self.config_class(**kwargs)

    def prepare_config_and_inputs_for_common(self) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length]).to(torch_device)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def _classes(*names: str) -> tuple[type, ...]:
    return tuple(getattr(transformers, name) for name in names)


class _Bound(ModelTesterMixin):
    config_class: type
    config: dict[str, object] = {}  # noqa: RUF012  (read only)

    def setUp(self) -> None:
        self.model_tester = TinyModelTester(self, self.config_class, **self.config)


class LlamaModelTest(_Bound, unittest.TestCase):
    config_class = transformers.LlamaConfig
    config = {"num_key_value_heads": 2}  # noqa: RUF012
    all_model_classes = _classes("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification",
                                 "LlamaForTokenClassification", "LlamaForQuestionAnswering")


class TiedLlamaModelTest(_Bound, unittest.TestCase):
    config_class = transformers.LlamaConfig
    config = {"tie_word_embeddings": True}  # noqa: RUF012
    all_model_classes = _classes("LlamaForCausalLM")


class Qwen2ModelTest(_Bound, unittest.TestCase):
    config_class = transformers.Qwen2Config
    config = {"num_key_value_heads": 2}  # noqa: RUF012
    all_model_classes = _classes("Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification")


class GPT2ModelTest(_Bound, unittest.TestCase):
    config_class = transformers.GPT2Config
    all_model_classes = _classes("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification",
                                 "GPT2ForTokenClassification")


class BertModelTest(_Bound, unittest.TestCase):
    config_class = transformers.BertConfig
    all_model_classes = _classes("BertModel", "BertForMaskedLM", "BertForSequenceClassification",
                                 "BertForTokenClassification", "BertForQuestionAnswering")
