"""Teacher routing: every cell resolves to weights summing to 1, or fails naming the cell."""
import pytest

from opd_jax.teachers import check_routing, teacher_weights

CELLS = [("general", "low"), ("general", "max"), ("coding", "max")]


def test_routing_modes():
    assert teacher_weights("general", "low", "cell") == {"general/low": 1.0}
    assert teacher_weights("coding", "max", "domain") == {"coding": 1.0}
    table = {"general": "stage1", "coding/max": "stage3"}
    assert teacher_weights("general", "max", "table", table=table) == {"stage1": 1.0}
    assert teacher_weights("coding", "max", "table", table=table) == {"stage3": 1.0}
    mix = {"general": {"a": 0.25, "b": 0.75}, "coding/max": {"b": 1.0, "a": 0.0}}
    assert teacher_weights("general", "low", "mixture", weights=mix) == {"a": 0.25, "b": 0.75}
    # A zero weight is dropped: that teacher is never loaded for the cell.
    assert teacher_weights("coding", "max", "mixture", weights=mix) == {"b": 1.0}


def test_check_routing_resolves_every_cell():
    out = check_routing(CELLS, ["general/low", "general/max", "coding/max"], "cell")
    assert out == {"general/low": {"general/low": 1.0}, "general/max": {"general/max": 1.0},
                   "coding/max": {"coding/max": 1.0}}


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(routing="cell", keys=["general/low", "general/max"]), KeyError,
     "no teacher for \\(domain, effort\\) 'coding/max': routing 'cell' asks for "
     "\\['coding/max'\\]"),
    (dict(routing="table", table={"general": "g"}, keys=["g"]), KeyError,
     "no teacher for \\(domain, effort\\) 'coding/max': teachers.table has neither"),
    (dict(routing="mixture", weights={"general": {"g": 0.5, "c": 0.4}, "coding": {"c": 1.0}},
          keys=["g", "c"], single_teacher=False), ValueError,
     "teacher weights for 'general/low' sum to 0.9, expected 1"),
    (dict(routing="mixture", weights={"general": {"g": 1.5, "c": -0.5}, "coding": {"c": 1}},
          keys=["g", "c"], single_teacher=False), ValueError, "must be >= 0"),
    (dict(routing="mixture", weights={"general": {"g": 1.0}}, keys=["g"],
          single_teacher=False), KeyError, "no teacher weights for \\(domain, effort\\) "
     "'coding/max'"),
    (dict(routing="mixture", weights={"general": {"g": 1.0}}, keys=["g"],
          single_teacher=True), ValueError, "needs the full-vocabulary objective"),
    (dict(routing="bogus", keys=["g"]), ValueError, "teachers.routing='bogus': expected one of"),
])
def test_check_routing_errors(kwargs, err, match):
    keys = kwargs.pop("keys")
    routing = kwargs.pop("routing")
    with pytest.raises(err, match=match):
        check_routing(CELLS, keys, routing, **kwargs)


def test_uniform_routing_weights_every_teacher_of_the_bank():
    from opd_jax.teachers.routing import check_routing
    out = check_routing([("general", "high"), ("coding", "low")], ["a", "b", "c", "d"],
                        "uniform")
    assert out == {c: {k: 0.25 for k in "abcd"} for c in ("general/high", "coding/low")}
    with pytest.raises(ValueError, match="routing='uniform' needs the full-vocabulary"):
        check_routing([("general", "high")], ["a"], "uniform", single_teacher=True)


def test_confidence_weights_favour_the_confident_teacher_and_keep_the_prior():
    """w ~ prior exp(-H / tau) per token, normalised over teachers: lower entropy, more
    weight; a teacher with prior 0 stays at 0; tau -> inf gives the prior back."""
    import numpy as np
    from opd_jax.teachers.routing import confidence_weights
    prior = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], np.float32)         # [B=2, S=3]
    H = np.broadcast_to(np.array([0.1, 1.0, 0.5], np.float32)[:, None, None], (3, 2, 4))  # [S, B, T]
    w = np.asarray(confidence_weights(prior, H, 1.0))                         # [2, 4, 3]
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert np.all(w[0, :, 2] == 0.0) and np.all(w[0, :, 0] > w[0, :, 1])
    want = prior[1] * np.exp(-np.array([0.1, 1.0, 0.5]))
    np.testing.assert_allclose(w[1, 0], want / want.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(confidence_weights(prior, H, 1e6))[:, 0], prior,
                               rtol=1e-5, atol=1e-6)
