"""Sliding-tile puzzle (the 8-/15-puzzle) as a multi-turn game.

The model sees the board, replies with one move, and the environment answers with the next
board. A move is ``<move>up</move>`` (``up``/``down``/``left``/``right`` move the *blank*) or
``slide N`` (tile N, next to the blank, slides into it). The episode ends when the board is
solved (reward 1 on that turn) or after ``max_moves`` moves (reward 0, or with
``shaping_weight`` > 0 that weight times the fraction of tiles in place). Invalid moves get a
feedback observation, count as a move and cost ``invalid_move_penalty``.

The game state travels in the per-sample metadata, so the environment itself is stateless.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from rl_core.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from rl_envs.base import (
    EnvConfig,
    batch_message_logs,
    batch_rewards,
    check_batch,
    last_assistant_text,
    make_return,
    mean,
    validate_config,
)

Board = list[list[int]]  # 0 is the blank
BLANK_MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
_MOVE_TAG = re.compile(r"<move>\s*(.*?)\s*</move>", re.IGNORECASE | re.DOTALL)
_SLIDE = re.compile(r"\bslide\s+(\d+)\b", re.IGNORECASE)
STOP_STRINGS = ["</move>"]
SOLVED_MARKER = "Solved in"

RULES = (
    "Solve the sliding puzzle: reach the board with tiles 1..N in order and the blank (_) last. "
    "Each turn, reply with exactly one move: <move>up</move>, <move>down</move>, <move>left</move> "
    "or <move>right</move> moves the blank in that direction; 'slide N' slides tile N into the blank."
)


class InvalidMoveError(ValueError):
    pass


def solved_board(size: int) -> Board:
    tiles = [*range(1, size * size), 0]
    return [tiles[r * size : (r + 1) * size] for r in range(size)]


def find_blank(board: Board) -> tuple[int, int]:
    for r, row in enumerate(board):
        for c, tile in enumerate(row):
            if tile == 0:
                return r, c
    raise InvalidMoveError("board has no blank (0)")


def apply_move(board: Board, move: str) -> Board:
    """The board after moving the blank ``move`` (``up``/``down``/``left``/``right``)."""
    if move not in BLANK_MOVES:
        raise InvalidMoveError(f"unknown move {move!r}; use one of {sorted(BLANK_MOVES)}")
    size = len(board)
    r, c = find_blank(board)
    dr, dc = BLANK_MOVES[move]
    nr, nc = r + dr, c + dc
    if not (0 <= nr < size and 0 <= nc < size):
        raise InvalidMoveError(f"cannot move the blank {move}: it is at the edge")
    new = [row[:] for row in board]
    new[r][c], new[nr][nc] = new[nr][nc], 0
    return new


def slide_to_move(board: Board, tile: int) -> str:
    """The blank move that slides ``tile`` into the blank."""
    r, c = find_blank(board)
    for move, (dr, dc) in BLANK_MOVES.items():
        nr, nc = r + dr, c + dc
        if 0 <= nr < len(board) and 0 <= nc < len(board) and board[nr][nc] == tile:
            return move
    raise InvalidMoveError(f"tile {tile} is not next to the blank")


def parse_move(text: str, board: Board) -> str:
    """The blank move a reply asks for (the last ``<move>`` tag, else the last ``slide N``)."""
    tags = _MOVE_TAG.findall(text or "")
    if tags:
        move = tags[-1].strip().lower()
        slide = _SLIDE.fullmatch(move)
        if slide:
            return slide_to_move(board, int(slide.group(1)))
        if move not in BLANK_MOVES:
            raise InvalidMoveError(f"unknown move {move!r}; use one of {sorted(BLANK_MOVES)} or 'slide N'")
        return move
    slides = _SLIDE.findall(text or "")
    if slides:
        return slide_to_move(board, int(slides[-1]))
    raise InvalidMoveError("no move found; answer like <move>up</move> or 'slide 5'")


def is_solvable(board: Board) -> bool:
    """Permutation-parity test (blank row counted from the bottom for even widths)."""
    size = len(board)
    tiles = [t for row in board for t in row if t != 0]
    inversions = sum(1 for i in range(len(tiles)) for j in range(i + 1, len(tiles)) if tiles[i] > tiles[j])
    if size % 2 == 1:
        return inversions % 2 == 0
    blank_row_from_bottom = size - find_blank(board)[0]
    return (inversions + blank_row_from_bottom) % 2 == 1


def validate_board(board: Any, where: str) -> Board:
    if not (isinstance(board, list) and board and all(isinstance(row, list) for row in board)):
        raise ValueError(f"{where}: a board is a square list of lists of ints, got {board!r}")
    size = len(board)
    if any(len(row) != size for row in board) or size < 2:
        raise ValueError(f"{where}: board must be square with side >= 2, got {board!r}")
    if sorted(t for row in board for t in row) != list(range(size * size)):
        raise ValueError(f"{where}: board must hold each of 0..{size * size - 1} exactly once, got {board!r}")
    if not is_solvable(board):
        raise ValueError(f"{where}: board {board!r} is not solvable")
    return [list(row) for row in board]


def generate_puzzle(size: int, scramble_moves: int, seed: int) -> Board:
    """A solvable board: ``scramble_moves`` random blank moves from the solved one (never
    undoing the previous move), continued until the board differs from the solution."""
    if size < 2 or scramble_moves < 1:
        raise ValueError(
            f"generate_puzzle: need size >= 2 and scramble_moves >= 1, got {size}, {scramble_moves}"
        )
    rng = random.Random(seed)
    board = solved_board(size)
    previous: str | None = None
    done = 0
    while done < scramble_moves or board == solved_board(size):
        r, c = find_blank(board)
        options = [
            m
            for m, (dr, dc) in BLANK_MOVES.items()
            if 0 <= r + dr < size and 0 <= c + dc < size and m != _OPPOSITE.get(previous or "")
        ]
        previous = rng.choice(options)
        board = apply_move(board, previous)
        done += 1
    return board


def render(board: Board) -> str:
    width = len(str(len(board) ** 2 - 1))
    return "\n".join(
        " ".join("_".rjust(width) if t == 0 else str(t).rjust(width) for t in row) for row in board
    )


def tiles_in_place(board: Board) -> float:
    goal = solved_board(len(board))
    tiles = [(t, g) for row, grow in zip(board, goal) for t, g in zip(row, grow) if g != 0]
    return sum(t == g for t, g in tiles) / len(tiles)


def initial_prompt(board: Board) -> str:
    """The first user message of an episode."""
    return f"{RULES}\n\nBoard:\n{render(board)}"


class SlidingPuzzleConfig(EnvConfig):
    size: int = Field(default=3, ge=2, le=6, description="board side when metadata does not give a board")
    scramble_moves: int = Field(default=8, ge=1, description="difficulty of generated boards")
    max_moves: int = Field(
        default=20, ge=1, description="moves (valid or not) before the episode ends unsolved"
    )
    invalid_move_penalty: float = Field(default=0.0, ge=0, description="subtracted from the turn's reward")
    shaping_weight: float = Field(
        default=0.0, ge=0, le=1, description="unsolved end: weight x fraction of tiles in place"
    )


class SlidingPuzzleEnvironment(EnvironmentInterface):
    """Multi-turn sliding puzzle; see the module docstring for the rules and rewards.

    Initial metadata: ``{"board": [[...]]}`` or ``{"seed": int}`` (optionally ``size``,
    ``scramble_moves``, ``max_moves``); the returned metadata carries the game state.
    """

    config_class = SlidingPuzzleConfig
    name = "sliding_puzzle"

    def __init__(self, config: SlidingPuzzleConfig | Mapping[str, Any] | None = None) -> None:
        self.config = validate_config(SlidingPuzzleConfig, config, "env.sliding_puzzle")

    def initial_state(self, metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
        cfg = self.config
        if "board" in metadata:
            board = validate_board(metadata["board"], f"{where}['board']")
        elif "seed" in metadata:
            size = int(metadata.get("size", cfg.size))
            board = generate_puzzle(
                size, int(metadata.get("scramble_moves", cfg.scramble_moves)), int(metadata["seed"])
            )
        else:
            raise ValueError(
                f"{where}: needs a 'board' or a 'seed' to start a puzzle (got keys {sorted(metadata)})"
            )
        return {
            "board": board,
            "moves": 0,
            "invalid_moves": 0,
            "max_moves": int(metadata.get("max_moves", cfg.max_moves)),
        }

    def _turn(self, text: str, state: dict[str, Any]) -> tuple[str, dict[str, Any], float, bool]:
        cfg = self.config
        board: Board = state["board"]
        state = {**state, "moves": state["moves"] + 1}
        reward = 0.0
        try:
            move = parse_move(text, board)
            board = apply_move(board, move)
            state["board"] = board
            feedback = f"Moved the blank {move}.\nBoard:\n{render(board)}"
        except InvalidMoveError as exc:
            state["invalid_moves"] += 1
            reward -= cfg.invalid_move_penalty
            feedback = f"Invalid move: {exc}.\nBoard:\n{render(board)}"
        if board == solved_board(len(board)):
            return f"{feedback}\n{SOLVED_MARKER} {state['moves']} moves.", state, reward + 1.0, True
        if state["moves"] >= state["max_moves"]:
            reward += cfg.shaping_weight * tiles_in_place(board)
            return f"{feedback}\nOut of moves ({state['max_moves']}).", state, reward, True
        return feedback, state, reward, False

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch(message_log_batch, metadata, self.name)
        observations: list[dict[str, str]] = []
        states: list[dict[str, Any] | None] = []
        rewards: list[float] = []
        dones: list[bool] = []
        answers: list[str | None] = []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata)):
            where = f"sliding_puzzle.step: metadata[{i}]"
            if not isinstance(meta, Mapping):
                raise ValueError(f"{where}: expected a mapping, got {meta!r}")
            state = dict(meta["game_state"]) if "game_state" in meta else self.initial_state(meta, where)
            text = last_assistant_text(log)
            feedback, state, reward, done = self._turn(text, state)
            observations.append({"role": "environment", "content": feedback})
            states.append(None if done else {**meta, "game_state": state})
            rewards.append(reward)
            dones.append(done)
            answers.append(render(state["board"]))
        return make_return(
            observations, states, [None if d else list(STOP_STRINGS) for d in dones], rewards, dones, answers
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """mean_reward; with ``message_log``: solve_rate (episodes whose last environment
        message reports the solution) and mean_turns (assistant turns per episode)."""
        rewards = batch_rewards(batch)
        metrics: dict[str, Any] = {"mean_reward": float(rewards.mean()) if rewards.numel() else 0.0}
        logs = batch_message_logs(batch)
        if logs is not None:
            metrics["solve_rate"] = mean(
                [float(SOLVED_MARKER in _last_environment_text(log)) for log in logs]
            )
            metrics["mean_turns"] = mean(
                [float(sum(m.get("role") == "assistant" for m in log)) for log in logs]
            )
        return batch, metrics


def _last_environment_text(log: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(log):
        if message.get("role") == "environment":
            return str(message.get("content") or "")
    return ""
