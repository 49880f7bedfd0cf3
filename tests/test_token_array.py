"""Array token fields (rollout/token_array.py): list semantics, validation, serialisation."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ValidationError

from rollout.token_array import NO_FLOATS, FloatArray, IntArray
from rollout.trajectory import Trajectory, Turn


class Fields(BaseModel):
    ids: IntArray
    lps: FloatArray = NO_FLOATS


def test_reads_like_the_list_it_replaces() -> None:
    ids = IntArray.of([5, 6, 7])
    assert len(ids) == 3 and ids[0] == 5 and type(ids[0]) is int and ids[-1] == 7
    assert ids[1:] == [6, 7] and isinstance(ids[1:], IntArray)
    assert list(ids) == [5, 6, 7] and all(type(x) is int for x in ids) and 6 in ids
    # + concatenates (never numpy's elementwise sum), with lists on either side
    assert ids + [8] == [5, 6, 7, 8] and [4] + ids == [4, 5, 6, 7] and ids + ids == [5, 6, 7] * 2
    assert type(ids + ids) is list
    acc = [1]
    acc += ids
    assert acc == [1, 5, 6, 7]
    assert ids == [5, 6, 7] and [5, 6, 7] == ids and ids == (5, 6, 7) and ids != [5, 6]
    assert ids != [5, 6, 8] and ids == IntArray.of(np.array([5, 6, 7], np.int32))
    assert repr(ids) == "[5, 6, 7]" and ids.tolist() == [5, 6, 7]
    with pytest.raises(TypeError):
        hash(ids)


def test_it_never_changes_in_place() -> None:
    source = np.array([1, 2, 3])
    ids = IntArray.of(source)
    source[0] = 9  # the caller's array was copied, not aliased
    assert ids == [1, 2, 3] and source.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ids.array[0] = 0
    assert copy.deepcopy(ids) is ids and copy.copy(ids) is ids


def test_numpy_torch_and_pickle_read_it() -> None:
    lps = FloatArray.of([-0.5, -1 / 3, -0.0])
    assert torch.equal(torch.tensor(lps), torch.tensor([-0.5, -1 / 3, -0.0]))  # as a list gives
    assert torch.equal(torch.tensor(lps.array), torch.tensor([-0.5, -1 / 3, -0.0], dtype=torch.float64))
    assert np.asarray(lps).dtype == np.float64 and np.asarray(lps, np.float32).dtype == np.float32
    back = pickle.loads(pickle.dumps(lps, protocol=5))
    assert back == lps and type(back) is FloatArray and not back.array.flags.writeable


def test_pydantic_validates_and_writes_lists() -> None:
    m = Fields(ids=(1, 2), lps=[0, -1.5])
    assert type(m.ids) is IntArray and m.ids.array.dtype == np.int64
    assert type(m.lps) is FloatArray and m.lps == [0.0, -1.5] and type(m.lps[0]) is float
    assert m.model_dump() == {"ids": [1, 2], "lps": [0.0, -1.5]}
    assert json.loads(m.model_dump_json()) == {"ids": [1, 2], "lps": [0.0, -1.5]}
    assert Fields.model_validate_json(m.model_dump_json()) == m
    assert Fields.model_json_schema()["properties"]["ids"] == {
        "items": {"type": "integer"}, "title": "Ids", "type": "array"}


@pytest.mark.parametrize("bad, says", [
    ([1.5], "float64 values"), ([True], "bool values"), ([[1]], "nested lists"),
    ([2**70], "integers past int64"), ("12", "got str"), (3, "got int"),
    (np.array([2**63], np.uint64), "fit int64, got uint64"),
])
def test_bad_ids_are_refused_naming_the_field(bad: object, says: str) -> None:
    with pytest.raises(ValidationError, match=says) as err:
        Fields(ids=bad)
    assert err.value.errors()[0]["loc"] == ("ids",)


def test_trajectory_assignments_are_validated_into_arrays() -> None:
    # Rollouts assign observations after the turn exists; the field stays an array.
    turn = Turn(action_ids=[1, 2], action_logprobs=[-0.1, -0.2], policy_version=0)
    assert turn.observation_ids == [] and type(turn.observation_ids) is IntArray
    turn.observation_ids = [3, 4]
    assert type(turn.observation_ids) is IntArray and turn.observation_ids == [3, 4]
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[])
    traj.prompt_ids = [9]
    traj.turns.append(turn)
    assert type(traj.prompt_ids) is IntArray and traj.token_ids() == [9, 1, 2, 3, 4]
    with pytest.raises(ValidationError, match="observation_ids"):
        turn.observation_ids = [0.5]


def test_a_row_is_built_from_the_arrays() -> None:
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1, 2], turns=[
        Turn(action_ids=[10, 11], action_logprobs=[-1.0, -2.0], policy_version=0, observation_ids=[20]),
        Turn(action_ids=[12], action_logprobs=[-3.0], policy_version=0)])
    ids, owner = traj.row(traj.segments()[0])
    assert ids == traj.token_ids() == [1, 2, 10, 11, 20, 12] and owner == [-1, -1, 0, 0, -1, 1]
    assert isinstance(ids, IntArray) and not ids.array.flags.writeable
