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
