"""The rows a run trains and evaluates on (load_rows): a built-in task (rewards.py), or --dataset: the rows of
a file, a folder or a dataset on the Hub, each checked (dataset_row).

A JSONL file is read here line by line, so that an error names its line. Everything else goes through Hugging
Face's `datasets` library, as TRL, open-instruct and verl take data (imported only then): a Parquet, CSV or
JSON file, a folder that `save_to_disk` wrote, or a Hub name where the network allows. --dataset-split picks
one split (default: `train`, or the only one; `train[:1000]` takes a slice where `datasets` loads the data);
an error names the split.

--dataset-columns renames columns, `prompt=question,answer=solution`: the prompt column is then `question`,
and the rewards get `answer` from `solution` (the source columns keep their own names too). A chat taken as
the prompt from another column (`prompt=messages`) loses the assistant turns that end it (the model writes
that turn); the last one's text becomes the column `answer` where the row has none.
"""

import json
import os
import re
from pathlib import Path

import rewards as rewards_module

# what the rewards get from the rollouts: a column of the same name would be hidden
ROLLOUT_FIELDS = set("prompts completions completion_ids tool_calls tool_failures truncated environments".split())
# the file types `datasets` reads by name (its packaged builders); JSONL is read here, line by line
BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}
HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


# FORK: load your data (or pass --dataset FILE; data.py reads it)
def load_rows(args):
    """Rows of {'prompt': messages, ...columns}, split into (train, eval)."""
    if args.dataset is None:
        rows = rewards_module.task_rows(
            5000 + args.eval_size, args.seed, args.task, args.max_operand, args.terms, args.operations
        )
    else:
        rows = dataset_rows(args)
    for row in rows:
        row["prompt"] = prompt_messages(row["prompt"], args.system_prompt)
    if len(rows) <= args.eval_size:
        raise SystemExit(f"--dataset has {len(rows)} rows, not more than --eval-size {args.eval_size}")
    return rows[args.eval_size :], rows[: args.eval_size]


def dataset_rows(args):
    """The rows of --dataset, each checked (dataset_row), their ids unique."""
    rows = []
    # id -> where; a rollout finds its prompt by its row's id
    seen = {}
    for where, raw in read_rows(args):
        row = dataset_row(raw, len(rows), where)
        if seen.setdefault(row["id"], where) != where:
            first = seen[row["id"]].rpartition(", ")[2]
            raise SystemExit(
                f"{where}: the id {row['id']!r} is {first}'s too; ids must be unique (or leave the column out)"
            )
        rows.append(row)
    return rows


def prompt_messages(prompt, system_prompt):
    """A row's prompt as chat messages (a string is one user turn), --system-prompt first unless it has
    one."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def dataset_row(row, index, where):
    """One row of --dataset (data.py), its id `index` unless it has one; or a SystemExit that says what is
    wrong."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(prompt, str) and not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)
    ):
        raise SystemExit(
            f"{where}: each row needs a 'prompt' field, a string or a non-empty list of chat messages "
            '{"role": ..., "content": ...} (--dataset-columns prompt=COLUMN names another column)'
        )
    shadowed = ROLLOUT_FIELDS & set(row)
    if shadowed:
        raise SystemExit(f"{where}: the rewards get {sorted(shadowed)} from the rollouts; rename the column")
    if not isinstance(row.setdefault("id", index), (str, int)):
        raise SystemExit(f"{where}: the id {row['id']!r} is not a string or integer")
    return row


def check_flags(args):
    """What is wrong with --dataset, --dataset-split and --dataset-columns before anything is read (a
    message), or None. A path that does not exist is taken for a Hub name only if it looks like one: `name`
    or `owner/name`, without the extension of a file type read here."""
    path = args.dataset
    optional = [("--dataset-split", args.dataset_split), ("--dataset-columns", args.dataset_columns)]
    given = [flag for flag, value in optional if value]
    if path is None:
        return f"{', '.join(given)}: needs --dataset" if given else None
    try:
        column_map(args.dataset_columns)
    except ValueError as e:
        return str(e)
    suffix = Path(path).suffix.lower()
    readable = suffix in BUILDERS or suffix == ".jsonl"
    if os.path.isfile(path) and not readable:
        return f"--dataset {path}: reads {', '.join(['.jsonl', *BUILDERS])} files or a folder"
    split = args.dataset_split
    if os.path.isfile(path) and suffix == ".jsonl" and split not in (None, "train"):
        return f"--dataset {path}: a JSONL file has one split, train; drop --dataset-split {split}"
    if not os.path.exists(path) and (readable or not HUB_NAME.fullmatch(path)):
        return f"--dataset: no file {path}"
    return None


def column_map(spec):
    """--dataset-columns `prompt=question,answer=solution` as {'prompt': 'question', 'answer': 'solution'}."""
    if not spec:
        return {}
    mapping = {}
    for item in spec.split(","):
        name, _, column = item.partition("=")
        if not name.strip() or not column.strip():
            raise ValueError(f"--dataset-columns {spec}: each item is NAME=COLUMN, e.g. prompt=question")
        mapping[name.strip()] = column.strip()
    return mapping


def read_rows(args):
    """[(where, row)]: every row of --dataset, its columns renamed by --dataset-columns; `where` names the
    file and line, or the dataset, split and row. A line that is not JSON, a column or split that is not
    there, a Hub name out of reach: a SystemExit that says so."""
    mapping = column_map(args.dataset_columns)
    if Path(args.dataset).suffix.lower() == ".jsonl" and os.path.isfile(args.dataset):
        rows = []
        for line_no, line in enumerate(Path(args.dataset).read_text().splitlines(), 1):
            if line.strip():
                where = f"--dataset {args.dataset}, line {line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{where}: not JSON ({e})")
                rows.append((where, renamed(row, mapping, where)))
        return rows
    table, split = load_split(args)
    where = f"--dataset {args.dataset} (split {split})"
    columns = table.column_names
    listed = ", ".join(columns)
    missing = sorted(set(mapping.values()) - set(columns))
    if missing:
        raise SystemExit(f"{where}: no column {missing} (--dataset-columns); its columns: {listed}")
    if "prompt" not in set(columns) | set(mapping):
        raise SystemExit(
            f"{where}: no column 'prompt'; its columns: {listed}: name it with --dataset-columns prompt=COLUMN"
        )
    return [(f"{where}, row {i}", renamed(row, mapping, where)) for i, row in enumerate(table)]


def load_split(args):
    """(one split as a datasets.Dataset, its name), of a local file or folder, or of a Hub name."""
    import datasets

    # its progress bars and cache notes would bury the run's own lines
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    path, split = args.dataset, args.dataset_split
    # save_to_disk's
    saved = any((Path(path) / name).is_file() for name in ("state.json", "dataset_dict.json"))
    # datasets keeps an Arrow copy of a file it loads: in --cache-dir, beside the run's other caches
    cache_dir = str(Path(args.cache_dir) / "datasets")
    try:
        if saved:
            loaded = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            builder = BUILDERS[Path(path).suffix.lower()]
            loaded = datasets.load_dataset(builder, data_files=path, split=split, cache_dir=cache_dir)
        else:  # a folder of data files, or a Hub name
            loaded = datasets.load_dataset(path, split=split, cache_dir=cache_dir)
    except Exception as e:
        what = f"split {split}" if split else "its splits"
        why = f"cannot load it ({type(e).__name__}: {str(e)[:300]})"
        if not os.path.exists(path):
            why += "; not a local file or folder, and not on the Hub from here: offline, "
            why += "save it where the network allows (save_to_disk) and pass that folder"
        raise SystemExit(f"--dataset {path} ({what}): {why}")
    if isinstance(loaded, datasets.Dataset):
        if saved and split not in (None, str(loaded.split)):
            raise SystemExit(
                f"--dataset {path}: a saved dataset of one split ({loaded.split or 'unnamed'}), not {split}"
            )
        return loaded, split or str(loaded.split or "train")
    names = list(loaded)
    name = split
    if name is None:
        name = "train" if "train" in names or len(names) > 1 else names[0]
    if name not in names:
        listed = ", ".join(names)
        raise SystemExit(f"--dataset {path}: no split {name}; its splits: {listed} (--dataset-split)")
    return loaded[name], name


def renamed(row, mapping, where):
    """The row with the columns of --dataset-columns. A chat taken as the prompt from another column loses
    the assistant turns that end it: the last one's text is the column `answer` where the row has none."""
    if not isinstance(row, dict):
        return row  # load_rows says what is wrong with it
    missing = sorted(set(mapping.values()) - set(row))
    if missing:
        raise SystemExit(f"{where}: no column {missing} (--dataset-columns); its columns: {', '.join(row)}")
    row = {**row, **{name: row[column] for name, column in mapping.items()}}
    chat = row.get("prompt")
    if isinstance(chat, list):
        # Arrow gives each message every key that any message has, None where it had none
        chat = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in chat]
        while (
            mapping.get("prompt", "prompt") != "prompt"
            and chat
            and isinstance(chat[-1], dict)
            and chat[-1].get("role") == "assistant"
        ):
            row.setdefault("answer", chat[-1].get("content"))
            chat = chat[:-1]
        row["prompt"] = chat
    return row
