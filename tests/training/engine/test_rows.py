"""helpers.training.engine.rows: the placeholder tokens and their trainable rows (naming, checks,
the rows added to the tokenizer and embedding, the hook that routes the embedding through them,
and writing them back into the matrix)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.training import models
from helpers.training.engine import TrainingInputError, rows

TOY = 5988  # "toy" in CLIP's vocabulary: one token


@pytest.fixture(scope="module")
def tokenizer():
    return models.build_clip_tokenizer()


class Encoder(torch.nn.Module):
    """What the hook and write_rows use of a text encoder: ``get_input_embeddings()``."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 3, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.arange(30, dtype=dtype).reshape(10, 3))
        self.embed.requires_grad_(False)

    def get_input_embeddings(self):
        return self.embed


def test_placeholder_token_names():
    assert rows.placeholder_tokens_for("<cat>", 3) == ["<cat>", "<cat>_1", "<cat>_2"]
    assert rows.placeholder_tokens_for("<cat>", 1) == ["<cat>"]
    with pytest.raises(TrainingInputError, match="num_vectors=0"):
        rows.placeholder_tokens_for("<cat>", 0)


def test_token_errors_before_heavy_work(tokenizer):
    with pytest.raises(TrainingInputError, match="'toy</w>'|already in the tokenizer") as err:
        rows.check_tokens(tokenizer, "toy</w>", "toy", 1)
    assert "choose a new token" in str(err.value)
    with pytest.raises(TrainingInputError, match="is 2 tokens"):
        rows.check_tokens(tokenizer, "<new>", "teddy bear", 1)
    assert rows.check_tokens(tokenizer, "<new>", "toy", 2) == TOY


def test_the_vectors_must_fit_in_the_longest_prompt_template(tokenizer, monkeypatch):
    """'a photo of a {}' takes 6 tokens with the start and end tokens: 71 of CLIP's 77 are left."""
    templates = ["a {}", "a photo of a {}"]
    with pytest.raises(TrainingInputError) as err:
        rows.check_tokens(tokenizer, "<new>", "toy", 72, templates)
    assert str(err.value) == (
        "num_vectors=72: at most 71 vectors fit in a prompt (CLIP reads 77 tokens and the longest prompt "
        "template, 'a photo of a {}', takes 6 of them), so vectors past that would never train. Fix: pass "
        "--num_vectors 71 or fewer."
    )
    # the edge, on a tokenizer that reads 9 tokens (each vector checked costs a copy of the vocabulary)
    monkeypatch.setattr(tokenizer, "model_max_length", 9)
    assert rows.check_tokens(tokenizer, "<new>", "toy", 3, templates) == TOY
    with pytest.raises(
        TrainingInputError, match=r"^num_vectors=4: at most 3 vectors fit in a prompt \(CLIP reads 9 tokens"
    ):
        rows.check_tokens(tokenizer, "<new>", "toy", 4, templates)


def test_add_placeholder_tokens_initialises_rows(tokenizer):
    from transformers import CLIPTextModel

    tok = copy.deepcopy(tokenizer)  # it gains the new tokens
    te = CLIPTextModel.from_pretrained(models.resolve_model("tiny"), subfolder="text_encoder")
    ids = rows.add_placeholder_tokens(tok, te, "<x>", "toy", num_vectors=2)
    assert ids == [49408, 49409] and len(tok) == 49410
    weight = te.get_input_embeddings().weight
    assert weight.shape == (49410, 32)
    assert torch.equal(weight[49408], weight[TOY]) and torch.equal(weight[49409], weight[TOY])
    assert tok("a <x> <x>_1 toy", add_special_tokens=False).input_ids == [320, 49408, 49409, TOY]


def test_learned_rows_replace_exactly_the_placeholder_positions():
    learned = rows.LearnedEmbeddings(torch.tensor([[1.0, 1.0], [2.0, 2.0]]), [100, 101])
    ids = torch.tensor([[1, 100, 101, 102, 99]])  # 102 and 99 are just outside the two new ids
    frozen = -ids.unsqueeze(-1).expand(1, 5, 2).to(torch.bfloat16)
    out = learned(ids, frozen)
    assert out.dtype == torch.bfloat16  # in the dtype the text encoder computes in
    assert out.tolist() == [[[-1, -1], [1, 1], [2, 2], [-102, -102], [-99, -99]]]
    assert learned.vectors.dtype == torch.float32 and learned.first_id == 100


def test_the_gradient_of_each_row_counts_its_occurrences():
    learned = rows.LearnedEmbeddings(torch.zeros(2, 3), [100, 101])
    ids = torch.tensor([[100, 100, 101, 7]])
    learned(ids, torch.zeros(1, 4, 3)).sum().backward()
    assert learned.vectors.grad.tolist() == [[2, 2, 2], [1, 1, 1]]


def test_placeholder_ids_must_be_contiguous():
    with pytest.raises(ValueError, match=r"placeholder token ids must be contiguous, got \[5, 7\]"):
        rows.LearnedEmbeddings(torch.zeros(2, 3), [5, 7])


def test_the_hook_routes_the_embedding_through_the_learned_rows_until_removed():
    encoder = Encoder()
    learned = rows.LearnedEmbeddings(torch.full((2, 3), 0.5), [8, 9])
    hook = rows.EmbeddingHook(encoder, learned)
    ids = torch.tensor([[1, 8, 9]])
    out = encoder.get_input_embeddings()(ids)
    assert out.tolist() == [[[3, 4, 5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]]
    out.sum().backward()
    assert learned.vectors.grad.tolist() == [[1, 1, 1], [1, 1, 1]] and encoder.embed.weight.grad is None
    hook.learned = lambda ids, out: out  # what sampling does once the rows are written into the matrix
    assert encoder.get_input_embeddings()(ids).tolist()[0][1] == [24, 25, 26]
    hook.remove()
    assert encoder.get_input_embeddings()(ids).tolist() == [[[3, 4, 5], [24, 25, 26], [27, 28, 29]]]


def test_write_rows_copies_the_vectors_into_the_matrix_in_its_dtype():
    encoder = Encoder(torch.bfloat16)
    vectors = torch.nn.Parameter(torch.tensor([[0.5, 1.5, -2.0], [3.0, 0.25, 8.0]]))
    rows.write_rows(encoder, [8, 9], vectors)
    weight = encoder.embed.weight
    assert weight.dtype == torch.bfloat16 and weight.grad_fn is None
    assert weight[8:].tolist() == [[0.5, 1.5, -2.0], [3.0, 0.25, 8.0]]
    assert weight[:8].tolist() == torch.arange(24, dtype=torch.bfloat16).reshape(8, 3).tolist()  # untouched
