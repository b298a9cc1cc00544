"""make_private's attribution check (independence.check_gradients, part 2): on its probe
examples, each example's per-sample gradient must be autograd's gradient of that example's
loss. It is what lets the engine copy one row of embedding ids shared by the batch (Hugging
Face's default position_ids, shape (1, T)) to every example: right when the model broadcasts
the row, wrong (a gradient credited to another example, outside the clip) when it indexes
it, which the check refuses.

The same check lets it read a row-wise layer's rows of examples flattened with their
positions, (B·T, d), as example-major (OPT's decoder layers): right for
(B, T, d).view(-1, d), wrong for a (T, B, d) flattened, which it refuses.

The refusals here fail if the check is removed (the indexing models and the rolled rule
would then be accepted); the ill-conditioned WRN failed the check's first form, which
compared each example with autograd on that example run alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privgrad
from privgrad.errors import PrivgradError
from privgrad.per_sample import GradSampler, rules
from privgrad.per_sample.independence import MAX_PROBE

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, T = 23, 7


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def token_ids(n=40, seed=1):
    return torch.randint(1, V, (n, T), generator=torch.Generator().manual_seed(seed))


def tiny_gpt2_lm():
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class SharedPositions(nn.Module):
    """Token plus position embeddings, the positions one (1, T) row for the batch; ``index``
    takes that row's output out (``pos(ids)[0]``) instead of broadcasting it."""

    def __init__(self, index=False, d=6):
        super().__init__()
        self.index = index
        self.emb, self.pos, self.head = nn.Embedding(V, d), nn.Embedding(T, d), nn.Linear(d, V)

    def forward(self, ids):
        pos = self.pos(torch.arange(ids.shape[1], device=ids.device)[None])
        return self.head(torch.tanh(self.emb(ids) + (pos[0] if self.index else pos)))


class RandomInEval(SharedPositions):
    """Adds noise in eval mode too (a custom random layer, not an nn.Dropout)."""

    def forward(self, ids):
        return super().forward(ids) + 0.1 * torch.randn(ids.shape[0], T, V)


def private(model, x, ids, seed=0, **kw):
    return privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.3), (x, ids), target_epsilon=3.0,
        epochs=1, batch_size=10, loss_fn=lm_loss, seed=seed, **kw,
    )  # fmt: skip


def train(trainer):
    for batch in trainer.batches():
        trainer.step(batch)
    return trainer


def test_hugging_face_default_positions_train_as_explicit_ones():
    """GPT2LMHeadModel called with input_ids only (its position ids one (1, T) row): the
    engine copies the row to each example, and the run's parameters and ε are those of the
    same run given position_ids of shape (B, T)."""
    ids = token_ids()
    runs, positions = [], torch.arange(T).expand(len(ids), T)
    for x in ({"input_ids": ids}, {"input_ids": ids, "position_ids": positions}):
        torch.manual_seed(0)
        model = tiny_gpt2_lm()
        runs.append((model, train(private(model, x, ids))))
    (shared, a), (explicit, b) = runs
    assert [type(m).__name__ for m in a.grad_sampler.expanded] == ["Embedding"]
    assert not b.grad_sampler.expanded and a.steps == b.steps > 0
    for p, q in zip(shared.parameters(), explicit.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert a.epsilon() == b.epsilon() <= 3.0 + 1e-6


def test_the_own_loop_copies_the_shared_row_as_make_private_does():
    """privgrad.attach on GPT-2 called with input_ids only: the user's forward and backward
    give make_private's parameters, bit for bit, and its ε."""
    ids = token_ids()
    kw = dict(target_epsilon=3.0, epochs=1, batch_size=10, loss_fn=lm_loss, seed=3)
    torch.manual_seed(0)
    ref = tiny_gpt2_lm()
    trainer = privgrad.make_private(
        ref, torch.optim.SGD(ref.parameters(), lr=0.3), ({"input_ids": ids}, ids), **kw
    )
    train(trainer)
    torch.manual_seed(0)
    own = tiny_gpt2_lm()
    own, optimizer, loader = privgrad.attach(
        own, torch.optim.SGD(own.parameters(), lr=0.3), ({"input_ids": ids}, ids), **kw
    )
    for x, y in loader:
        optimizer.zero_grad()
        lm_loss(own(**x).logits, y).sum().backward()
        optimizer.step()
    assert optimizer.steps == trainer.steps > 0 and optimizer.epsilon() == trainer.epsilon()
    for p, q in zip(ref.parameters(), own.parameters()):
        assert torch.equal(p, q)


def test_a_model_that_broadcasts_a_shared_row_is_accepted_and_one_that_indexes_it_refused():
    ids = token_ids()
    torch.manual_seed(0)
    model = SharedPositions()
    before = model.pos.weight.detach().clone()
    trainer = train(private(model, ids, ids))
    assert trainer.grad_sampler.expanded == {model.pos}
    assert not torch.equal(before, model.pos.weight)
    with pytest.raises(PrivgradError, match=r"'pos.weight'.*'pos'.*indexes the row"):
        private(SharedPositions(index=True), ids, ids)


class SharedRowAtLargeBatches(SharedPositions):
    """Indexes one shared row of positions, but only for batches of more examples than
    make_private's probe has: the probe never sees it."""

    def forward(self, ids):
        n = len(ids)
        rows = torch.arange(T)[None] if n > MAX_PROBE else torch.arange(T).expand(n, T)
        pos = self.pos(rows)
        return self.head(torch.tanh(self.emb(ids) + (pos[0] if n > MAX_PROBE else pos)))


def test_a_shared_row_the_check_did_not_see_is_refused_at_the_step():
    """Rows are copied only for the layers the check saw called so: this model passes
    make_private (its probe batch gives one row per example) and is refused at its first
    step, where copying the row would credit example 0 with every example's gradient."""
    trainer = private(SharedRowAtLargeBatches(), token_ids(), token_ids())
    assert not trainer.grad_sampler.expanded
    with pytest.raises(PrivgradError, match=r"'pos'.*only for the layers its check saw"):
        train(trainer)


def test_a_bare_sampler_refuses_a_shared_row_with_the_fix():
    """Without make_private's check (a GradSampler used directly), the row is not copied."""
    ids = token_ids(5)
    with pytest.raises(PrivgradError, match=r"'pos'.*pass position_ids of shape \(B, T\)"):
        GradSampler(SharedPositions()).compute(ids, ids, lm_loss)


def test_a_model_random_in_eval_mode_is_checked_alike():
    """Both forwards of the check draw alike (the RNG seeded the same), so a model that is
    random in eval mode passes when it broadcasts the shared row and is refused when it
    indexes it."""
    train(private(RandomInEval(), token_ids(), token_ids()))
    with pytest.raises(PrivgradError, match=r"'pos.weight'.*indexes the row"):
        private(RandomInEval(index=True), token_ids(), token_ids())


def _triples_in_training(module, inputs, out):
    return out * 3 if module.training else out


class RandomInTraining(SharedPositions):
    """Adds noise in training only (its draws alike in both of the check's forwards)."""

    def forward(self, ids):
        out = super().forward(ids)
        return out + 0.1 * torch.randn_like(out) if self.training else out


def test_code_run_only_in_training_is_checked_too():
    """A forward hook that scales a layer's output in training only made the engine's
    per-sample gradients of that layer a third of autograd's (its rule reads the hooked
    output as the layer's own): each step's true sensitivity three times the clip, ε
    understated. The check ran in eval mode and passed it; it now compares in training mode
    too, and refuses it, while a model random in training only passes and trains."""
    model = SharedPositions()
    model.emb.register_forward_hook(_triples_in_training)
    with pytest.raises(PrivgradError, match=r"'emb.weight'.*in training mode only"):
        private(model, token_ids(), token_ids())
    train(private(RandomInTraining(), token_ids(), token_ids()))


def test_an_ill_conditioned_model_passes():
    """A GroupNorm WRN on real CIFAR-10 images: in float32 one of the first 4 examples'
    gradients moves by about 1 % between a batch of 4 and a batch of 1 (a near-constant
    channel under GroupNorm), for autograd too, so the check compares with autograd on the
    same batch, not each example run alone."""
    from privgrad.app.data import load_dataset
    from privgrad.app.models.wrn import wrn

    data = load_dataset("cifar10", limit_train=8)
    torch.manual_seed(0)
    model = wrn(depth=10, width=1)
    privgrad.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), (data.train_x, data.train_y),
        target_epsilon=2.0, epochs=1, batch_size=4,
        loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"),
    )  # fmt: skip


def test_a_rule_crediting_an_example_with_anothers_gradient_is_refused(monkeypatch):
    """A linear rule whose sums take example i's weight for example i+1 (a rule bug that
    leaves the batch sum, and so the coverage check, unchanged) is refused by attribution."""
    weighted_sum = rules.LinearGrads.weighted_sum
    monkeypatch.setattr(
        rules.LinearGrads, "weighted_sum", lambda self, w: weighted_sum(self, w.roll(1))
    )
    with pytest.raises(PrivgradError, match=r"'head.weight'.*example 0.*privgrad bug"):
        private(SharedPositions(), token_ids(), token_ids())
    monkeypatch.undo()
    train(private(SharedPositions(), token_ids(), token_ids()))


class FlattenedRows(nn.Module):
    """Token embeddings whose (B·T, d) rows go through a LayerNorm and a Linear, flattened
    from (B, T, d) as OPT's decoder layers do, or, with ``positions_first``, from (T, B, d)
    (row r then belongs to example r % B, not r // T)."""

    def __init__(self, positions_first=False, d=6):
        super().__init__()
        self.positions_first = positions_first
        self.emb, self.norm, self.head = nn.Embedding(V, d), nn.LayerNorm(d), nn.Linear(d, V)

    def forward(self, ids):
        h = self.emb(ids)
        if self.positions_first:
            h = h.transpose(0, 1)
        out = self.head(torch.tanh(self.norm(h.reshape(-1, h.shape[-1])))).view(*h.shape[:2], V)
        return out.transpose(0, 1) if self.positions_first else out


def test_flattened_rows_are_read_example_major_and_a_positions_first_flatten_refused():
    """A bare sampler refuses the flattened rows; make_private's check accepts them for the
    row-wise layers it saw (their per-sample gradients then equal the loop's), and refuses
    the (T, B, d) flatten, whose rows are not example-major."""
    ids = token_ids()
    with pytest.raises(PrivgradError, match=r"'norm'.*70 rows are 7 per example.*r // 7"):
        GradSampler(FlattenedRows()).compute(ids[:10], ids[:10], lm_loss)
    torch.manual_seed(0)
    model = FlattenedRows()
    sampler = GradSampler(model)
    sampler.assume_layouts = True  # as make_private's check leaves it
    grads, _ = sampler.compute(ids[:5], ids[:5], lm_loss)
    assert sampler.folded == {model.norm, model.head}
    params = list(model.parameters())
    for i in range(5):
        one_hot = torch.zeros(5)
        one_hot[i] = 1
        want = torch.autograd.grad(lm_loss(model(ids[i : i + 1]), ids[i : i + 1]).sum(), params)
        for got, w in zip(grads.weighted_sum(one_hot), want):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6)
    trainer = train(private(FlattenedRows(), ids, ids))
    assert {trainer.grad_sampler.names[m] for m in trainer.grad_sampler.folded} == {"norm", "head"}
    assert trainer.steps > 0
    with pytest.raises(
        PrivgradError,
        match=r"'norm', 'head' were called on a multiple of the batch's rows.*another order",
    ):
        private(FlattenedRows(positions_first=True), ids, ids)
