"""The validated, versioned recipe shared by the Python API, the CLI and YAML files.

A recipe says *what* to do to a model: the method with its own typed settings (``settings.py``)
and the calibration data. (Where and in what precision a job runs is not the recipe's business: see
``runtime.Execution``.)

Versions (docs/design.md, "Recipes and versions"): every output folder holds its recipe with every
value resolved, and the ``blockfold_version`` that ran it, so it replays as it ran whatever the
defaults of the blockfold that replays it. A hand-written recipe that leaves a setting out takes the
running blockfold's default. ``recipe_version`` is the schema's version: it changes only when a field
is renamed, removed or read differently, never for a new default; a default's history is in
docs/defaults.md. Versions 1-11, written before this rule, were bumped per default and are migrated
to what they ran (each migration below says what changed; ``_keep_old_default`` gives a recipe that
left a setting to the default the default of its version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, SerializeAsAny, model_validator

from blockfold.errors import BlockfoldError
from blockfold.schema import Strict
from blockfold.settings import SETTINGS, MethodSettings

RECIPE_VERSION = 12


class CalibrationConfig(Strict):
    """Where calibration text comes from and how it becomes token batches.

    ``source=None`` lets the model write its own calibration text (self-generated calibration).
    ``packing=None`` packs plain-text corpora into consecutive full-length sequences and keeps
    instruction data one example per (padded) sequence.
    """

    source: str | None = None
    num_sequences: int = Field(64, ge=1)
    sequence_length: int = Field(512, ge=8)
    max_documents: int | None = Field(None, ge=1)
    text_field: str | None = None
    # render each record with str.format, e.g. "{support}\n{question}\n{correct_answer}" (benchmark splits)
    text_template: str | None = None
    packing: bool | None = None
    use_chat_template: bool = True
    padding_side: Literal["right", "left"] = "right"
    # packing: what ends a document ("eos": the tokenizer's EOS; "blank-line": recipe version 2's
    # "\n\n" join), and whether every sequence starts as a text does (BOS where the tokenizer adds it)
    document_separator: Literal["eos", "blank-line"] = "eos"
    start_every_sequence: bool = True
    batch_size: int = Field(8, ge=1)
    generation_temperature: float = Field(1.0, gt=0)
    generation_top_p: float = Field(0.95, gt=0, le=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check_sources(self) -> "CalibrationConfig":
        parts = calibration_sources(self.source)
        if len(parts) > self.num_sequences:
            raise ValueError(f"a mix of {len(parts)} sources needs at least {len(parts)} sequences (num_sequences)")
        return self

    def share_of_first(self, count: int | None) -> float:
        """The share of the calibration sequences that the first ``count`` are (all where None): what a
        method that scores on a few sequences (``CalibrationSet.first_sequences``) runs, for its plan."""
        return 1.0 if count is None else min(count, self.num_sequences) / self.num_sequences


SELF_GENERATED = "self"


def calibration_sources(source: str | None) -> list[tuple[str, float]]:
    """``"a.jsonl:0.5,b.json:0.5"`` → ``[("a.jsonl", 0.5), ("b.json", 0.5)]`` (weights normalised to 1).

    One source needs no weight; in a mix, either every part has a weight or none (equal shares).
    ``self`` (or no source at all) is text the model writes itself.
    """
    if source is None:
        return [(SELF_GENERATED, 1.0)]
    parts = [part.strip() for part in source.split(",") if part.strip()]
    if not parts:
        raise ValueError("calibration source is empty: give a file, a dataset, a mix 'a:0.5,b:0.5' or 'self'")
    named = []
    for part in parts:
        name, _, weight = part.rpartition(":")
        try:
            named.append((name, float(weight)))
        except ValueError:
            named.append((part, None))
    if len(named) == 1:
        return [(named[0][0], 1.0)]
    if any(w is None for _, w in named) and not all(w is None for _, w in named):
        raise ValueError(f"calibration mix {source!r}: give every part a weight ('a:0.5,b:0.5') or none")
    if all(w is None for _, w in named):
        return [(name, 1.0 / len(named)) for name, _ in named]
    if any(w <= 0 for _, w in named):
        raise ValueError(f"calibration mix {source!r}: weights must be positive")
    total = sum(w for _, w in named)
    return [(name, w / total) for name, w in named]


class Recipe(Strict):
    """``method`` with its ``settings``, and the calibration data.

    For convenience the method's settings may also be given flat, ``Recipe(method="nbl", attention_layers=4)``;
    a flat field the method does not have is an error naming the method's own settings.
    """

    recipe_version: Literal[12] = RECIPE_VERSION
    #: the blockfold that wrote the recipe (set when it is saved with a run; a record, not a constraint)
    blockfold_version: str | None = None
    method: str = "replaceme"
    settings: SerializeAsAny[MethodSettings]
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    #: the healing stage after the compression (``blockfold heal``'s settings); None: no healing. Its data
    #: left without a source heals on the calibration source
    heal: "HealConfig | None" = None

    @model_validator(mode="before")
    @classmethod
    def _route_settings(cls, data):
        if not isinstance(data, dict):
            return data
        data = migrate(data)
        method = data.get("method", "replaceme")
        if method not in SETTINGS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(sorted(SETTINGS))}")
        settings_class = SETTINGS[method]
        given = data.get("settings") or {}
        if isinstance(given, MethodSettings):
            if not isinstance(given, settings_class):
                raise ValueError(f"settings of {type(given).__name__} given for method {method!r}")
            given = given.model_dump(exclude_unset=True)
        flat = {key: data.pop(key) for key in list(data) if key not in cls.model_fields}
        merged = {**given, **flat}
        unknown = sorted(set(merged) - set(settings_class.model_fields))
        if unknown:
            raise ValueError(f"{', '.join(unknown)} {'does' if len(unknown) == 1 else 'do'} not apply to method "
                             f"{method!r}; its settings are {', '.join(settings_class.model_fields)}")
        data["settings"] = settings_class.model_validate(merged)
        return data

    @model_validator(mode="after")
    def _consistent_heal(self):
        if self.heal is None:
            return self
        if self.heal.mode == "lt" and not self.settings.folds_maps():
            raise ValueError(f"healing mode lt trains the down-projections a fitted map was folded into, and "
                             f"{self.method} folds none: use --heal lora (heal.mode: lora)")
        if "source" not in self.heal.data.model_fields_set and self.calibration.source:
            self.heal.data._resolve("source", self.calibration.source)
        return self

    @classmethod
    def of(cls, settings: MethodSettings, calibration: CalibrationConfig | dict | None = None) -> "Recipe":
        """The recipe of a settings object (the Python API's ``compress(model, ReplaceMe(...))``)."""
        return cls(method=settings.method, settings=settings, calibration=calibration or CalibrationConfig())

    # -- YAML -----------------------------------------------------------------------------
    def saved(self) -> dict:
        """The recipe as saved with a run: every value resolved, and the version of this blockfold."""
        from blockfold import __version__

        return {**self.model_dump(mode="json"), "blockfold_version": __version__}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.saved(), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Recipe":
        return cls.parse(read_recipe_file(path), origin=str(path))


def read_recipe_file(path: str | Path) -> dict:
    """A recipe file's values, brought to this version but not yet validated: the CLI puts its flags
    on top of them and validates once, so a file plus flags is the same recipe as the values alone."""
    path = Path(path)
    if not path.is_file():
        raise BlockfoldError(f"recipe file {path} not found: pass an existing YAML file to --recipe")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise BlockfoldError(f"recipe file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings", {}) or {}, dict):
        raise BlockfoldError(f"recipe file {path} must hold a mapping (method:, settings:, calibration:)")
    try:
        return migrate(data)
    except (ValueError, TypeError, AttributeError) as err:
        raise BlockfoldError(f"recipe file {path} cannot be read as a recipe ({err})") from None


def migrate(data: dict) -> dict:
    """An older recipe's values as this version's, each migration one version up, in order."""
    data = dict(data)
    for version, step in _MIGRATIONS.items():
        if data.get("recipe_version") == version:
            data = step(data)
    return data


#: version 1's flat method fields (it wrote every one, whether the method used it or not)
_V1_FIELDS = ("blocks", "attention_layers", "ratio", "estimator", "rank", "span_start", "ridge_alpha", "criterion",
              "spans", "linearity_criterion", "greedy", "sandwich_fold", "cosine")
#: version 1 resolved ``criterion: null`` at run time to these
_V1_CRITERIA = {"replaceme": "fit_error_stream", "uidl": "angular_last"}


def _migrate_v1(data: dict) -> dict:
    """A version 1 recipe as version 2: each method keeps the fields it uses, and ``criterion: null``
    becomes the default version 1 applied at run time."""
    data = dict(data)
    method = data.get("method", "replaceme")
    fields = SETTINGS[method].model_fields if method in SETTINGS else {}
    settings = {}
    for key in _V1_FIELDS:
        value = data.pop(key, None)
        if key == "criterion" and value is None:
            value = _V1_CRITERIA.get(method)
        if key in fields and value is not None:
            settings[key] = value
    return {**data, "recipe_version": 2, "settings": settings}


def _migrate_v2(data: dict) -> dict:
    """A version 2 recipe as version 3, running as it did: blank-line packing without a start per
    sequence, and ReplaceMe's total ridge as a per-token one over the recipe's sequences x length
    (exact for packed data, where every sequence is full)."""
    calibration = dict(data.get("calibration") or {})
    calibration.setdefault("document_separator", "blank-line")
    calibration.setdefault("start_every_sequence", False)
    settings = data.get("settings") or {}
    if isinstance(settings, dict) and data.get("method", "replaceme") == "replaceme" and settings.get("ridge_alpha"):
        defaults = CalibrationConfig.model_fields
        tokens = (calibration.get("num_sequences", defaults["num_sequences"].default)
                  * calibration.get("sequence_length", defaults["sequence_length"].default))
        settings = {**settings, "ridge_alpha": settings["ridge_alpha"] / tokens}
    return {**data, "recipe_version": 3, "calibration": calibration, "settings": settings}


def _migrate_v3(data: dict) -> dict:
    """A version 3 recipe as version 4: ReplaceMe's ``auto`` fold (written, or left to the default)
    compared the two sandwich folds' losses, which version 4 calls ``compare``."""
    settings = data.get("settings") or {}
    # identity folds nothing, and a constrained map was folded linearized-norm by version 3's auto as
    # by version 4's: only an unconstrained map's auto compared the folds
    compared = settings.get("estimator", "lstsq") not in ("identity", "diagonal", "orthogonal", "lowrank") \
        if isinstance(settings, dict) else False
    if compared and data.get("method", "replaceme") == "replaceme" and settings.get("sandwich_fold", "auto") == "auto":
        settings = {**settings, "sandwich_fold": "compare"}
    return {**data, "recipe_version": 4, "settings": settings}


def _migrate_v4(data: dict) -> dict:
    """A version 4 recipe as version 5: ReplaceMe's span criterion, left to the default, was
    ``fit_error_stream``; version 5's default is ``fit_error``."""
    return _keep_old_default(data, ("replaceme",), "criterion", "fit_error_stream", 5)


def _migrate_v5(data: dict) -> dict:
    """A version 5 recipe as version 6: NBL's ranking, left to the default, was ``cosine`` on every
    architecture; version 6's default ``auto`` ranks by ``nmse`` on sandwich-norm attention."""
    return _keep_old_default(data, ("nbl",), "linearity_criterion", "cosine", 6)


def _migrate_v6(data: dict) -> dict:
    """A version 6 recipe as version 7: ReplaceMe scored candidate spans with the map its estimator
    folds; version 7 scores them with the least-squares map whatever is folded."""
    return _keep_old_default(data, ("replaceme", "uidl"), "span_scoring", "estimator", 7)


def _migrate_v7(data: dict) -> dict:
    """A version 7 recipe as version 8: ReplaceMe folded the map and refitted nothing; version 8
    refits the down-projections around each span by default."""
    return _keep_old_default(data, ("replaceme",), "refit", "none", 8)


def _migrate_v8(data: dict) -> dict:
    """A version 8 recipe as version 9: ReplaceMe's refit fitted the weights alone; version 9 also fits
    the stream's scale after each span (where a refit runs)."""
    return _keep_old_default(data, ("replaceme",), "refit_scale", False, 9)


def _migrate_v9(data: dict) -> dict:
    """A version 9 recipe as version 10: ReplaceMe's default refit corrected the down-projections
    (version 10 also the input projections, ``all``); where it resolved to none it stays none."""
    settings = data.get("settings") or {}
    if isinstance(settings, dict) and data.get("method", "replaceme") == "replaceme" and "refit" not in settings:
        refitted = settings.get("estimator", "lstsq") == "lstsq" and not settings.get("greedy", False)
        settings = {**settings, "refit": "down" if refitted else "none"}
    return {**data, "recipe_version": 10, "settings": settings}


def _migrate_v10(data: dict) -> dict:
    """A version 10 recipe as version 11: ReplaceMe's refit left sandwich blocks as they were; version 11
    corrects their input projections (with ``refit: all``)."""
    return _keep_old_default(data, ("replaceme",), "refit_sandwich", False, 11)


def _migrate_v11(data: dict) -> dict:
    """A version 11 recipe as version 12: ReplaceMe scored candidate spans with the lstsq map alone;
    version 12 compares that span with the folded map's where they differ."""
    return _keep_old_default(data, ("replaceme",), "span_scoring", "lstsq", RECIPE_VERSION)


def _keep_old_default(data: dict, methods: tuple[str, ...], field: str, value, version: int) -> dict:
    """``data`` as recipe ``version``: a recipe of one of ``methods`` that left ``field`` to the default
    keeps the ``value`` it ran with, since the new version's default differs."""
    settings = data.get("settings") or {}
    if isinstance(settings, dict) and data.get("method", "replaceme") in methods and field not in settings:
        settings = {**settings, field: value}
    return {**data, "recipe_version": version, "settings": settings}


#: recipe version -> the migration that brings it one version up
_MIGRATIONS = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3, 4: _migrate_v4, 5: _migrate_v5, 6: _migrate_v6,
               7: _migrate_v7, 8: _migrate_v8, 9: _migrate_v9, 10: _migrate_v10,
               11: _migrate_v11}


def _healing_data() -> CalibrationConfig:
    return CalibrationConfig(num_sequences=400, sequence_length=256, batch_size=4)


class HealConfig(Strict):
    """``blockfold heal``: a few next-token training steps on ``data``, merged back into the weights."""

    heal_version: Literal[1] = 1
    mode: Literal["lt", "lora"] = "lt"  # lt: only the down-projections holding folded maps
    steps: int = Field(100, ge=1)
    learning_rate: float | None = Field(None, gt=0)  # None: 1e-4 for lt, 5e-4 for lora
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    seed: int = 0
    data: CalibrationConfig = Field(default_factory=_healing_data)

    @model_validator(mode="after")
    def _default_learning_rate(self) -> "HealConfig":
        if self.learning_rate is None:
            self._resolve("learning_rate", 1e-4 if self.mode == "lt" else 5e-4)
        return self


Recipe.model_rebuild()
