"""Turn advantages broadcast to action tokens, shifted once for next-token prediction."""

from __future__ import annotations

import numpy as np
import torch

from tests.test_trajectory import make_traj
from learner.batching import build_token_batch, padding_cuts


def test_advantages_land_on_action_tokens_only() -> None:
    traj = make_traj()  # tokens [1,2,3,10,11,20,21,22,12]; actions at 3,4 (turn 0) and 8 (turn 1)
    short = make_traj()
    short.turns = short.turns[1:]  # tokens [1,2,3,12]
    adv = np.array([0.5, -1.0, 2.0])  # turn0, turn1 of traj; turn0 of short
    tb = build_token_batch([traj, short], adv, np.array([True, True, True]), pad_id=0)
    # entry j describes token j+1: traj tokens 1..8 -> mask at j=2,3 (tokens 3,4) and j=7 (token 8)
    torch.testing.assert_close(tb.loss_mask[0], torch.tensor([0, 0, 1, 1, 0, 0, 0, 1.0]))
    torch.testing.assert_close(tb.advantages[0], torch.tensor([0, 0, 0.5, 0.5, 0, 0, 0, -1.0]))
    torch.testing.assert_close(tb.behaviour[0], torch.tensor([0, 0, -0.5, -0.25, 0, 0, 0, -1.0]))
    assert tb.turn_ids[0].tolist() == [-1, -1, 0, 0, -1, -1, -1, 1]
    # the short row is right-padded: only its one action token trains, with its own advantage
    torch.testing.assert_close(tb.loss_mask[1], torch.tensor([0, 0, 1.0, 0, 0, 0, 0, 0]))
    assert tb.advantages[1, 2].item() == 2.0 and tb.turn_ids[1, 2].item() == 2
    assert tb.attention_mask[1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert tb.num_tokens == 4.0


def test_masked_turn_trains_nothing_and_rows_trim_padding() -> None:
    traj, short = make_traj(), make_traj()
    short.turns = short.turns[1:]
    tb = build_token_batch([traj, short], np.ones(3), np.array([False, True, True]), pad_id=0)
    assert tb.loss_mask[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1.0]
    sub = tb.rows(1, 2)
    assert sub.input_ids.shape == (1, 4) and sub.loss_mask.shape == (1, 3)


def test_windowed_trajectory_trains_each_turn_on_its_own_context() -> None:
    from tests.test_trajectory import windowed_traj

    win = windowed_traj(1)  # rows [1,2,10,20,11] (turns 0,1), [1,2,11,21,12] (2), [1,2,12,22,13] (3)
    plain = make_traj()     # one row, turns 4 and 5 of the batch
    adv = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tb = build_token_batch([win, plain], adv, np.array([True, True, False, True, True, True]), pad_id=0)
    assert tb.input_ids.shape == (4, 9)
    assert tb.input_ids[:3, :5].tolist() == [[1, 2, 10, 20, 11], [1, 2, 11, 21, 12], [1, 2, 12, 22, 13]]
    # row 0 trains turns 0 and 1 (tokens 2 and 4); row 1 trains nothing: turn 2 is masked and
    # turn 1's action there is context; row 2 trains turn 3
    assert tb.loss_mask[:3, :4].tolist() == [[0, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert tb.advantages[0, :4].tolist() == [0, 1.0, 0, 2.0] and tb.advantages[2, 3].item() == 4.0
    assert tb.turn_ids[0, :4].tolist() == [-1, 0, -1, 1] and tb.turn_ids[2, 3].item() == 3
    torch.testing.assert_close(tb.behaviour[0, :4], torch.tensor([0, -0.1, 0, -0.2]))
    torch.testing.assert_close(tb.behaviour[2, :4], torch.tensor([0, 0, 0, -0.4]))
    # the whole-episode trajectory after it keeps its single row and its own turn ids
    assert tb.input_ids[3].tolist() == plain.token_ids() and tb.turn_ids[3, 7].item() == 5
    assert tb.num_tokens == 3 + 3


def test_rows_sort_by_length_within_each_ranks_share_of_each_mini_batch() -> None:
    from learner.batching import by_length, rank_micro_batches

    long_, short = make_traj(), make_traj()
    short.turns = short.turns[1:]  # 4 tokens against 9
    trajs = [short, long_, short, long_, long_, short, short, long_]
    tb = build_token_batch(trajs, np.arange(12.0), np.ones(12, dtype=bool), pad_id=0)
    lengths = tb.attention_mask.sum(-1).tolist()
    assert lengths == [4, 9, 4, 9, 9, 4, 4, 9]
    parts, world = [(0, 4), (4, 8)], 2  # two optimizer steps, each shared by two ranks
    out = by_length(tb, parts, world)
    assert out.attention_mask.sum(-1).tolist() == [9, 4, 9, 4, 9, 4, 9, 4]
    # every rank trains the same rows in the same optimizer step as before (rows [0, 1] of
    # step one: trajectories 0 and 1, now longest first), each row whole and its own
    assert out.row_traj.tolist() == [1, 0, 3, 2, 4, 5, 7, 6]
    for field in ("input_ids", "loss_mask", "advantages", "behaviour", "turn_ids"):
        torch.testing.assert_close(getattr(out, field), getattr(tb, field)[out.row_traj])
    # one rank, micro-batches of 2: in arrival order each pads a short row to 9 tokens;
    # sorted, half of them hold short rows only and are trimmed to 4
    one = by_length(tb, [(0, 8)], 1)
    widths = [one.rows(a, b).input_ids.size(1) for a, b in rank_micro_batches(0, 8, 0, 1, 2)]
    before = [tb.rows(a, b).input_ids.size(1) for a, b in rank_micro_batches(0, 8, 0, 1, 2)]
    assert widths == [9, 9, 4, 4] and before == [9, 9, 9, 9]


def test_padding_cuts_split_where_rows_pad_least() -> None:
    # six short rows and ten long ones: equal halves would pad two short-and-long groups
    lengths = [30] * 6 + [100] * 10
    assert padding_cuts(lengths, 2) == [(0, 6), (6, 16)]
    assert padding_cuts([10, 11, 50, 51, 90, 95], 3) == [(0, 2), (2, 4), (4, 6)]
    # one group when a cut saves nothing; never more groups than rows
    assert padding_cuts([40, 40, 40], 2) == [(0, 3)]
    assert padding_cuts([5], 4) == [(0, 1)] and padding_cuts([], 2) == []
    # the cuts cover every row once, in order, and pad no more than any other split
    lengths = sorted(np.random.default_rng(0).integers(20, 200, size=16).tolist())
    spans = padding_cuts(lengths, 2)
    assert [a for a, _ in spans[1:]] == [b for _, b in spans[:-1]] and spans[0][0] == 0 and spans[-1][1] == 16
    padded = sum((b - a) * lengths[b - 1] for a, b in spans)
    assert padded == min(k * lengths[k - 1] + (16 - k) * lengths[-1] for k in range(1, 17))


def test_a_trajectory_with_no_turns_trains_nothing_and_breaks_nothing() -> None:
    # An episode that failed before its first action (its engine died) has a prompt and no
    # turns; last in a batch, nothing of it may index the turn arrays past their end.
    traj, empty = make_traj(), make_traj()
    empty.turns = []
    tb = build_token_batch([traj, empty], np.array([0.5, -1.0]), np.array([True, True]), pad_id=0)
    assert tb.loss_mask[1].sum().item() == 0 and tb.advantages[1].abs().sum().item() == 0
    assert (tb.turn_ids[1] == -1).all()
    torch.testing.assert_close(tb.loss_mask[0], torch.tensor([0, 0, 1, 1, 0, 0, 0, 1.0]))
    tb = build_token_batch([empty], np.zeros(0), np.zeros(0, dtype=bool), pad_id=0)
    assert tb.num_tokens == 0.0
