"""Sliding puzzle: seeded solvable boards, move parsing, scripted episodes to success and failure."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from rl_envs.sliding_puzzle import (
    SlidingPuzzleEnvironment,
    generate_puzzle,
    is_solvable,
    validate_board,
)

GOAL3 = ((1, 2, 3), (4, 5, 6), (7, 8, 0))
DELTAS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def goal(size: int) -> tuple[tuple[int, ...], ...]:
    tiles = [*range(1, size * size), 0]
    return tuple(tuple(tiles[r * size : (r + 1) * size]) for r in range(size))


def neighbours(board: tuple[tuple[int, ...], ...]):
    """Reference move generator, written independently of the environment."""
    size = len(board)
    flat = [t for row in board for t in row]
    b = flat.index(0)
    r, c = divmod(b, size)
    for move, (dr, dc) in DELTAS.items():
        nr, nc = r + dr, c + dc
        if 0 <= nr < size and 0 <= nc < size:
            new = flat[:]
            new[b], new[nr * size + nc] = new[nr * size + nc], 0
            yield (
                move,
                flat[nr * size + nc],
                tuple(tuple(new[i * size : (i + 1) * size]) for i in range(size)),
            )


def bfs_solution(board: list[list[int]]) -> list[tuple[str, int, tuple]]:
    """Shortest list of (blank move, tile moved, resulting board)."""
    start = tuple(tuple(row) for row in board)
    target = goal(len(board))
    parents: dict = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state == target:
            break
        for move, tile, nxt in neighbours(state):
            if nxt not in parents:
                parents[nxt] = (state, move, tile)
                queue.append(nxt)
    path = []
    state = target
    while parents[state] is not None:
        prev, move, tile = parents[state]
        path.append((move, tile, state))
        state = prev
    return path[::-1]


def board_in(observation: str) -> tuple[tuple[int, ...], ...]:
    rows = observation.split("Board:\n", 1)[1].strip().splitlines()
    grid = [
        [0 if cell == "_" else int(cell) for cell in row.split()]
        for row in rows
        if row and row[0] in " _0123456789"
    ]
    return tuple(tuple(row) for row in grid)


def test_generated_boards_are_seeded_solvable_and_scrambled() -> None:
    boards = [generate_puzzle(3, 12, seed) for seed in range(20)]
    assert generate_puzzle(3, 12, 7) == boards[7]
    assert len({str(b) for b in boards}) > 10
    for board in boards:
        assert is_solvable(board)
        assert tuple(map(tuple, board)) != GOAL3
        assert 0 < len(bfs_solution(board)) <= 12
    four = generate_puzzle(4, 10, 3)
    assert is_solvable(four) and sorted(t for row in four for t in row) == list(range(16))


def test_solvability_parity_and_board_validation() -> None:
    assert is_solvable([[1, 2, 3], [4, 5, 6], [7, 8, 0]])
    assert not is_solvable([[2, 1, 3], [4, 5, 6], [7, 8, 0]])
    assert not is_solvable([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 15, 14, 0]])
    with pytest.raises(ValueError, match=r"metadata\[0\]\['board'\]: board .* is not solvable"):
        validate_board([[2, 1, 3], [4, 5, 6], [7, 8, 0]], "metadata[0]['board']")
    with pytest.raises(ValueError, match="exactly once"):
        validate_board([[1, 1, 3], [4, 5, 6], [7, 8, 0]], "metadata[0]['board']")


def play(env: SlidingPuzzleEnvironment, first_metadata: dict, replies: list[str]):
    """Drive one episode: returns the per-turn (reward, terminated, observation)."""
    log: list[dict] = [{"role": "user", "content": "puzzle", "token_ids": torch.arange(2)}]
    metadata = first_metadata
    turns = []
    for text in replies:
        log.append({"role": "assistant", "content": text, "token_ids": torch.arange(3)})
        ret = env.step([log], [metadata])
        turns.append((float(ret.rewards[0]), bool(ret.terminateds[0]), ret.observations[0]["content"]))
        log.append({**ret.observations[0], "token_ids": torch.arange(1)})
        if ret.terminateds[0]:
            assert ret.metadata[0] is None and ret.next_stop_strings[0] is None
            break
        assert ret.next_stop_strings[0] == ["</move>"]
        metadata = ret.metadata[0]
    return turns, log


def test_scripted_optimal_policy_solves_the_puzzle() -> None:
    env = SlidingPuzzleEnvironment({"max_moves": 30})
    board = generate_puzzle(3, 14, seed=11)
    solution = bfs_solution(board)
    # Alternate the two accepted move formats.
    replies = [
        f"I move the blank <move>{move}</move>" if k % 2 == 0 else f"I will slide {tile}"
        for k, (move, tile, _) in enumerate(solution)
    ]
    turns, log = play(env, {"board": board}, replies)
    assert len(turns) == len(solution)
    assert [t[0] for t in turns] == [0.0] * (len(solution) - 1) + [1.0]
    assert [t[1] for t in turns] == [False] * (len(solution) - 1) + [True]
    for (_, _, expected_board), (_, _, observation) in zip(solution, turns):
        assert board_in(observation) == expected_board
    _, metrics = env.global_post_process_and_metrics({"rewards": torch.tensor([1.0]), "message_log": [log]})
    assert metrics["solve_rate"] == 1.0 and metrics["mean_turns"] == len(solution)


def test_seeded_metadata_generates_the_same_board() -> None:
    env = SlidingPuzzleEnvironment({"size": 3, "scramble_moves": 6})
    solution = bfs_solution(generate_puzzle(3, 6, seed=5))
    turns, _ = play(env, {"seed": 5}, [f"<move>{move}</move>" for move, _, _ in solution])
    assert turns[-1][:2] == (1.0, True) and len(turns) == len(solution)


def test_invalid_moves_end_unsolved_with_penalty_and_shaping() -> None:
    env = SlidingPuzzleEnvironment({"max_moves": 4, "invalid_move_penalty": 0.1, "shaping_weight": 0.5})
    board = [[1, 2, 3], [4, 5, 6], [7, 0, 8]]  # one move ('right') from solved
    replies = ["<move>diagonal</move>", "<move>down</move>", "slide 1", "no idea"]
    turns, log = play(env, {"board": board}, replies)
    assert len(turns) == 4
    assert all("Invalid move" in obs for _, _, obs in turns)
    assert [t[1] for t in turns] == [False, False, False, True]
    # Tiles 1..7 are in place, 8 is not: 7/8 of the tiles; every turn also cost 0.1.
    assert [t[0] for t in turns] == pytest.approx([-0.1, -0.1, -0.1, -0.1 + 0.5 * 7 / 8])
    assert "Out of moves (4)" in turns[-1][2]
    _, metrics = env.global_post_process_and_metrics(
        {"rewards": torch.tensor([sum(t[0] for t in turns)]), "message_log": [log]}
    )
    assert metrics["solve_rate"] == 0.0


def test_wrong_moves_run_out_of_moves_with_reward_zero() -> None:
    env = SlidingPuzzleEnvironment({"max_moves": 6})
    board = generate_puzzle(3, 8, seed=2)
    moves = ["up", "down", "up", "down", "left", "left"]
    # Reference simulation: an impossible move leaves the board unchanged.
    expected = []
    state = tuple(tuple(row) for row in board)
    for move in moves:
        state = next((nxt for m, _, nxt in neighbours(state) if m == move), state)
        expected.append(state)
    assert GOAL3 not in expected
    turns, _ = play(env, {"board": board}, [f"<move>{m}</move>" for m in moves])
    assert [t[0] for t in turns] == [0.0] * 6
    assert [t[1] for t in turns] == [False] * 5 + [True]
    assert [board_in(obs) for _, _, obs in turns] == expected


def test_metadata_without_a_board_or_seed_is_rejected() -> None:
    env = SlidingPuzzleEnvironment()
    log = [{"role": "assistant", "content": "<move>up</move>", "token_ids": torch.arange(1)}]
    with pytest.raises(ValueError, match=r"metadata\[0\]: needs a 'board' or a 'seed'"):
        env.step([log], [{"difficulty": 3}])
