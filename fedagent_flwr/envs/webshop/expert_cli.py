"""``fedagent webshop-expert``: play WebShop training goals with the expert policy
(:mod:`fedagent_flwr.envs.webshop.expert`) and write the episodes as JSON lines, SFT data for a
warm start; 0 on success, 2 with one line naming the culprit on bad input.

    fedagent webshop-expert --data-dir /work/shared/data/webshop --episodes 100 --out expert.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedagent_flwr.atomic import parent_problem
from fedagent_flwr.cli import program
from fedagent_flwr.envs.webshop.data import ATTRIBUTES_FILE, DATA_ENV_VAR, PRODUCTS_FILE
from fedagent_flwr.envs.webshop.env import WebShopEnv
from fedagent_flwr.envs.webshop.expert import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PROMPT_LENGTH,
    DEFAULT_MAX_RESPONSE_LENGTH,
    DEFAULT_MAX_TURNS,
    DEFAULT_SEARCH_RETURN_N,
    EXPERT_SPLIT,
    FIXED_ACTIONS,
    MODES,
    WINDOWED_MAX_PROMPT_LENGTH,
    WINDOWED_MAX_RESPONSE_LENGTH,
    EpisodeSettings,
    ExpertInputError,
    ReplyTooLongError,
    WebShopExpert,
    expert_env_config,
    write_expert_file,
)
from fedagent_flwr.rollout.episode import ChatTemplateError, require_chat_template


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("python -m fedagent_flwr.envs.webshop.expert_cli"),
        description="Play WebShop training goals with the expert (oracle) policy and write the episodes "
                    "as JSON lines (SFT data for a warm start).")
    parser.add_argument("--data-dir", default=None,
                        help="WebShop data directory (default: $FEDAGENT_WEBSHOP_DATA)")
    parser.add_argument("--split", default=EXPERT_SPLIT, help="goal split; only 'train' is accepted (default)")
    parser.add_argument("--episodes", type=int, default=100, help="episodes to play (default 100)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="episodes use seeds first-seed, first-seed+1, ... (seed s plays train goal s %% 6410)")
    parser.add_argument("--model", default="",
                        help="model directory (or hub id) whose tokenizer renders the chat: it must hold the "
                             "tokenizer's files ('' = the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, help="output JSON-lines file (written via a temp name + rename)")
    parser.add_argument("--mode", default="concat", choices=MODES, help="rollout mode (default concat, the recipe's)")
    parser.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS,
                        help=f"turns an episode may take (at least 1; default {DEFAULT_MAX_TURNS})")
    parser.add_argument("--search-return-n", type=int, default=DEFAULT_SEARCH_RETURN_N,
                        help=f"results a search returns (at least 1; default {DEFAULT_SEARCH_RETURN_N})")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="tokens a reply may take: at least the expert's shortest reply with EOS, counted "
                             f"with --model's tokenizer (default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--max-prompt-length", type=int, default=0,
                        help=f"0 (default): the mode's recipe's ({DEFAULT_MAX_PROMPT_LENGTH} concat, "
                             f"{WINDOWED_MAX_PROMPT_LENGTH} windowed)")
    parser.add_argument("--max-response-length", type=int, default=0,
                        help=f"0 (default): the mode's recipe's ({DEFAULT_MAX_RESPONSE_LENGTH} concat, "
                             f"{WINDOWED_MAX_RESPONSE_LENGTH} windowed)")
    parser.add_argument("--history-length", type=int, default=2,
                        help="windowed mode: steps each prompt shows (0 or more)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    return parser


#: argparse destination -> (option, least value) of each numeric option. This command checks them
#: itself, before anything is loaded, so that a message names the option the user typed rather than the
#: setting (``max_new_tokens``) that :class:`EpisodeSettings` would name. A budget of 0 is the recipe's.
LEAST: dict[str, tuple[str, int]] = {
    "episodes": ("--episodes", 1),
    "first_seed": ("--first-seed", 0),
    "max_turns": ("--max-turns", 1),
    "search_return_n": ("--search-return-n", 1),
    "max_new_tokens": ("--max-new-tokens", 1),
    "max_prompt_length": ("--max-prompt-length", 0),
    "max_response_length": ("--max-response-length", 0),
    "history_length": ("--history-length", 0),
}


def _check_numbers(args: argparse.Namespace) -> None:
    """ExpertInputError naming the first numeric option below its least value (:data:`LEAST`)."""
    for dest, (option, least) in LEAST.items():
        if (value := getattr(args, dest)) < least:
            raise ExpertInputError(f"{option} must be >= {least}, got {value}")


def _check_model_dir(model: str) -> None:
    """ExpertInputError naming ``--model`` when it is a local folder without a tokenizer's files.

    Why: only the tokenizer is loaded (a folder of them alone, without ``config.json``, serves), and
    from a folder without one transformers does not say so: an empty one ends in advice to install
    sentencepiece, one with only ``config.json`` in "the tokenizer has no chat template". Checked
    before the bundled model or anything else is loaded; a hub id is left to the download.
    """
    from fedagent_flwr.trainers.common.warm_start import TOKENIZER_FILES  # warm-start's own check's list

    folder = Path(model).expanduser()
    if not model.strip() or not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return
    where = f"--model {model}: {folder.resolve()}"
    if (folder / "config.json").is_file():
        raise ExpertInputError(f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                               "save the model's tokenizer into it (tokenizer.save_pretrained)")
    raise ExpertInputError(f"{where} holds no model (no config.json, and none of {', '.join(TOKENIZER_FILES)}); "
                           "give a Hugging Face model directory (as save_pretrained writes it) or leave --model "
                           "empty for the bundled SmolLM2-135M-Instruct")


def _load_tokenizer(model: str) -> Any:
    from fedagent_flwr.models.smollm2 import ModelResolutionError, resolve_model_path

    try:
        path = resolve_model_path(model)
    except ModelResolutionError as exc:
        raise ExpertInputError(str(exc)) from None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ExpertInputError(f"no usable tokenizer in {path}: {exc}") from None
    try:
        require_chat_template(tokenizer, str(path))
    except ChatTemplateError as exc:
        raise ExpertInputError(str(exc)) from None
    return tokenizer


def _check_data_dir(data_dir: str | None) -> None:
    """ExpertInputError unless ``--data-dir`` (or ``$FEDAGENT_WEBSHOP_DATA``) names a directory
    holding the catalogue files.

    Why here and not only in the env's check: that one speaks to a run's config (``env.data_dir``,
    ``python -m ...download``); this command's user sets ``--data-dir`` and has ``fedagent download-webshop``.
    """
    source = "--data-dir"
    if not data_dir:
        data_dir, source = os.environ.get(DATA_ENV_VAR) or None, f"${DATA_ENV_VAR}"
    if data_dir is None:
        raise ExpertInputError(f"no WebShop data directory: pass --data-dir DIR (or set {DATA_ENV_VAR}); "
                               "fetch the data with: fedagent download-webshop DIR")
    path = Path(data_dir).expanduser()
    for name in (PRODUCTS_FILE, ATTRIBUTES_FILE):
        if not (path / name).is_file():
            raise ExpertInputError(f"{source} {path} has no {name}; fetch the data with: "
                                   f"fedagent download-webshop {path}")


def _check_out_parent(out: Path) -> None:
    """ExpertInputError unless the directory that will hold ``--out`` exists or can be made: the
    atomic write makes it only when it writes, after every episode was played."""
    if problem := parent_problem(out):
        raise ExpertInputError(f"--out {out}: {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    """``fedagent webshop-expert``: write expert episodes; 0 on success, 2 on bad input."""
    args = _parser().parse_args(argv)
    try:
        _check_numbers(args)
        if Path(args.out).is_dir():
            raise ExpertInputError(f"--out {args.out} is a directory; give a file name")
        _check_out_parent(Path(args.out))
        _check_model_dir(args.model)
        config = expert_env_config(args.data_dir, args.split, args.max_turns, args.search_return_n)
        settings = EpisodeSettings(args.mode, args.max_turns, args.max_new_tokens, args.max_prompt_length,
                                   args.max_response_length, args.history_length)
        _check_data_dir(args.data_dir)  # in this command's words: --data-dir, fedagent download-webshop
        WebShopEnv.check_config(config)  # the rest of the config
        tokenizer = _load_tokenizer(args.model)
        least = WebShopExpert.min_new_tokens(tokenizer)
        if args.max_new_tokens < least:
            raise ExpertInputError(f"--max-new-tokens must be >= {least} (the expert's shortest reply, "
                                   f"{FIXED_ACTIONS[-1]!r}, with EOS), got {args.max_new_tokens}")
    except ValueError as exc:  # ExpertInputError and the env's config errors
        print(f"fedagent webshop-expert: error: {exc}", file=sys.stderr)
        return 2
    seeds = range(args.first_seed, args.first_seed + args.episodes)
    try:
        summary = write_expert_file(args.out, config, tokenizer, seeds, settings,
                                    log=None if args.quiet else lambda line: print(line, flush=True))
    except ReplyTooLongError as exc:  # a goal whose product or option name does not fit; no file written
        print(f"fedagent webshop-expert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {summary.line()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
