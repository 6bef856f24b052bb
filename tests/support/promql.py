"""PromQL for the tests: which series and labels an expression names, checked against
what the daemons really export.

A misspelt metric or label is no syntax error to Prometheus or Grafana: the alert never
fires, the panel stays empty. So the alert rules and the Grafana dashboard are read with
the small parser below and every name is looked up in :func:`exported_series`, which
builds the daemons' own metric objects into fresh registries and collects their sample
names (``_total``, ``_bucket``, ``_sum``, ``_count``, ``_created``) and labels.

The parser covers the PromQL the repository's files use (selectors, ranges, functions,
aggregations with ``by``/``without``, binary operators with ``bool``, ``on``/
``ignoring`` and ``group_left``/``group_right``); anything else (``offset``, ``@``,
subqueries) is refused with a :class:`PromQLError` rather than passed unchecked.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from consumer.policy import AttemptOutcome
from outbox.metrics import QUEUES, CallbackMetrics, ConsumerMetrics, DispatcherMetrics
from outbox.states import OperationState

# Prometheus adds these to every series it scrapes, and makes `up` for every target.
TARGET_LABELS = frozenset({"job", "instance"})
PROMETHEUS_SERIES: Mapping[str, frozenset[str]] = {"up": frozenset()}

# Label values a matcher may name, where the code fixes the set (`=` and `!=` only).
KNOWN_VALUES: Mapping[tuple[str, str], frozenset[str]] = {
    ("outbox_operations", "state"): frozenset(str(state) for state in OperationState),
    ("outbox_effect_attempts_total", "outcome"): frozenset(str(o) for o in AttemptOutcome),
    ("outbox_queue_messages", "queue"): frozenset(QUEUES),
}


def exported_series() -> dict[str, frozenset[str]]:
    """Sample name -> label names, for every sample the dispatcher, the consumer and
    `outbox callbacks serve` expose.

    A labelled metric exposes nothing until it has a child, so each gets one first (the
    registries are fresh and thrown away). ``le`` comes with the ``_bucket`` samples.
    """
    series: dict[str, frozenset[str]] = {}
    for metrics in (
        DispatcherMetrics.create(CollectorRegistry()),
        ConsumerMetrics.create(CollectorRegistry()),
        CallbackMetrics.create(CollectorRegistry()),
    ):
        for attribute in dataclasses.fields(metrics):
            metric = getattr(metrics, attribute.name)
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                metric.labels(*("sample" for _ in metric._labelnames))
        for family in metrics.registry.collect():
            for sample in family.samples:
                labels = series.get(sample.name, frozenset()) | frozenset(sample.labels)
                series[sample.name] = labels
    return series


class PromQLError(ValueError):
    """The expression is not PromQL, or uses PromQL this reader does not cover."""


# --- Lexer -------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<range>\[[^\]]*\])
    | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^=<>(){},@])
    """,
    re.VERBOSE,
)
# A range: durations like 5m or 1h30m, or a Grafana variable such as $__rate_interval.
_DURATION = re.compile(r"(?:\d+(?:ms|[smhdwy]))+|\$\{?\w+\}?")


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    position: int


def tokens(expr: str) -> list[Token]:
    found: list[Token] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if not match:
            raise PromQLError(f"cannot read {expr[position : position + 20]!r} at {position}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            found.append(Token(kind, match.group(), position))
        position = match.end()
    found.append(Token("end", "", len(expr)))
    return found


# --- Language --------------------------------------------------------------------------

AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
# Aggregations whose first argument is a parameter (a number, or a label for count_values).
PARAMETRIC = frozenset({"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"})

# Argument kinds: "v" instant vector, "m" range vector, "s" scalar, "str" string; a
# trailing "?" marks an optional one. The result is an instant vector keeping the labels
# of the vector argument, except for the functions handled by name in _Parser.call.
_OVER_TIME = ("avg", "min", "max", "sum", "count", "last", "stddev", "stdvar", "present")
FUNCTIONS: Mapping[str, tuple[str, ...]] = {
    **{name: ("m",) for name in ("rate", "irate", "increase", "delta", "idelta", "deriv")},
    **{name: ("m",) for name in ("changes", "resets", "absent_over_time")},
    **{f"{name}_over_time": ("m",) for name in _OVER_TIME},
    "quantile_over_time": ("s", "m"),
    "predict_linear": ("m", "s"),
    **{name: ("v",) for name in ("abs", "ceil", "floor", "exp", "ln", "log2", "log10")},
    **{name: ("v",) for name in ("sqrt", "sort", "sort_desc", "timestamp", "absent")},
    "round": ("v", "s?"),
    "clamp": ("v", "s", "s"),
    "clamp_min": ("v", "s"),
    "clamp_max": ("v", "s"),
    "histogram_quantile": ("s", "v"),
    "label_replace": ("v", "str", "str", "str", "str"),
    "scalar": ("v",),
    "vector": ("s",),
    "time": (),
}
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool"})
KEYWORDS |= {"offset", "and", "or", "unless", "atan2"}

# Binary operators by precedence, lowest first; `^` is right-associative.
PRECEDENCE: Mapping[str, int] = {
    "or": 1,
    "and": 2,
    "unless": 2,
    **{op: 3 for op in ("==", "!=", "<=", "<", ">=", ">")},
    "+": 4,
    "-": 4,
    **{op: 5 for op in ("*", "/", "%", "atan2")},
    "^": 6,
}
COMPARISONS = frozenset({"==", "!=", "<=", "<", ">=", ">"})
SET_OPERATORS = frozenset({"and", "or", "unless"})


@dataclass(frozen=True)
class Value:
    """What an expression evaluates to: its type and, for vectors, the labels it can carry."""

    kind: str  # "v", "m", "s" or "str"
    labels: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


@dataclass
class Reading:
    """Everything :func:`read` found in one expression."""

    selectors: list[Selector] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class _Parser:
    def __init__(self, expr: str, series: Mapping[str, frozenset[str]]) -> None:
        self.tokens = tokens(expr)
        self.at = 0
        self.series = series
        self.reading = Reading()
        # After an unknown series, what labels are in scope is unknown: no label problems
        # follow from it (the unknown series is the problem to report).
        self.unknown_series = False

    # Tokens.
    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.at + ahead, len(self.tokens) - 1)]

    def take(self, text: str | None = None, kind: str | None = None) -> Token:
        token = self.peek()
        if (text is not None and token.text != text) or (kind is not None and token.kind != kind):
            wanted = text or kind
            raise PromQLError(f"expected {wanted!r} at {token.position}, found {token.text!r}")
        self.at += 1
        return token

    def is_next(self, text: str) -> bool:
        return self.peek().text == text and self.peek().kind in ("op", "ident")

    def problem(self, message: str) -> None:
        self.reading.problems.append(message)

    # Grammar.
    def parse(self) -> Value:
        value = self.expression(0)
        self.take(kind="end")
        return value

    def expression(self, minimum: int) -> Value:
        left = self.unary()
        while True:
            operator = self.peek().text if self.peek().kind in ("op", "ident") else ""
            precedence = PRECEDENCE.get(operator)
            if precedence is None or precedence < minimum:
                return left
            self.take()
            left = self.binary(operator, left, precedence)

    def unary(self) -> Value:
        if self.peek().text in ("-", "+") and self.peek().kind == "op":
            self.take()
            value = self.unary()
            if value.kind not in ("v", "s"):
                raise PromQLError("a unary sign needs a scalar or an instant vector")
            return value
        value = self.primary()
        token = self.peek()
        if token.kind == "range" or token.text in ("offset", "@"):
            # Subqueries ([1h:5m] after an expression), offset and @ are not covered.
            raise PromQLError(f"{token.text!r} at {token.position} is not covered by this reader")
        return value

    def binary(self, operator: str, left: Value, precedence: int) -> Value:
        returns_bool = operator in COMPARISONS and self.is_next("bool")
        if returns_bool:
            self.take()
        matching, matching_labels = "", frozenset[str]()
        if self.is_next("on") or self.is_next("ignoring"):
            matching = self.take().text
            matching_labels = self.label_list()
        grouping, include = "", frozenset[str]()
        if self.is_next("group_left") or self.is_next("group_right"):
            grouping = self.take().text
            include = self.label_list() if self.is_next("(") else frozenset()
        right = self.expression(precedence + (operator != "^"))
        for side in (left, right):
            if side.kind not in ("v", "s"):
                raise PromQLError(f"{operator!r} needs scalars or instant vectors")
        if operator in SET_OPERATORS and "s" in (left.kind, right.kind):
            raise PromQLError(f"{operator!r} needs instant vectors on both sides")
        if left.kind == "s" and right.kind == "s":
            return Value("s")
        if "s" in (left.kind, right.kind):
            return left if left.kind == "v" else right
        return self.match_vectors(
            operator, left, right, (matching, matching_labels), (grouping, include), returns_bool
        )

    def match_vectors(
        self,
        operator: str,
        left: Value,
        right: Value,
        matching: tuple[str, frozenset[str]],
        grouping: tuple[str, frozenset[str]],
        returns_bool: bool,
    ) -> Value:
        how, labels = matching
        group, include = grouping
        if how == "on":
            self.missing_labels(f"on{sorted(labels)}", labels, left.labels & right.labels)
        elif how == "ignoring":
            self.missing_labels(f"ignoring{sorted(labels)}", labels, left.labels | right.labels)
        elif (
            operator not in SET_OPERATORS
            and left.labels != right.labels
            and not self.unknown_series
        ):
            self.problem(
                f"{operator!r} between series labelled {sorted(left.labels)} and "
                f"{sorted(right.labels)} matches nothing without on(...) or ignoring(...)"
            )
        one_side = right if group == "group_left" else left
        self.missing_labels(f"{group}{sorted(include)}", include, one_side.labels)
        if operator in SET_OPERATORS:
            return Value("v", left.labels | right.labels if operator == "or" else left.labels)
        many = right if group == "group_right" else left
        if group:
            return Value("v", many.labels | include)
        if operator in COMPARISONS and not returns_bool:
            return left  # a filter keeps the left sample as it is
        if how == "on":
            return Value("v", labels)
        return Value("v", left.labels - labels)

    def primary(self) -> Value:
        token = self.peek()
        if token.kind == "number":
            self.take()
            return Value("s")
        if token.kind == "string":
            self.take()
            return Value("str")
        if token.text == "(" and token.kind == "op":
            self.take()
            value = self.expression(0)
            self.take(")")
            return value
        if token.kind != "ident":
            raise PromQLError(f"unexpected {token.text!r} at {token.position}")
        name = token.text
        if name.lower() in ("inf", "nan"):
            self.take()
            return Value("s")
        if name in AGGREGATIONS:
            return self.aggregation()
        if self.peek(1).text == "(":
            if name not in FUNCTIONS:
                raise PromQLError(f"unknown function {name!r} at {token.position}")
            return self.call()
        if name in KEYWORDS:
            raise PromQLError(f"{name!r} out of place at {token.position}")
        return self.selector()

    def selector(self) -> Value:
        name = self.take(kind="ident").text
        matchers: list[tuple[str, str, str]] = []
        if self.is_next("{"):
            self.take("{")
            while not self.is_next("}"):
                label = self.take(kind="ident").text
                operator = self.take(kind="op").text
                if operator not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher operator {operator!r} for {label!r}")
                value = self.take(kind="string").text[1:-1]
                matchers.append((label, operator, value))
                if not self.is_next("}"):
                    self.take(",")
            self.take("}")
        kind = "v"
        if self.peek().kind == "range":
            token = self.take()
            if not _DURATION.fullmatch(token.text[1:-1].strip()):
                raise PromQLError(f"unsupported range {token.text!r} at {token.position}")
            kind = "m"
        self.reading.selectors.append(Selector(name, tuple(matchers)))
        exported = self.series.get(name)
        if exported is None:
            self.problem(f"{name} is not a series the daemons export")
            self.unknown_series = True
            return Value(kind, TARGET_LABELS)
        labels = exported | TARGET_LABELS
        for label, operator, value in matchers:
            if label not in labels:
                self.problem(f"{name} has no label {label!r} (it has {sorted(labels)})")
            known = KNOWN_VALUES.get((name, label))
            if known is not None and operator in ("=", "!=") and value not in known:
                self.problem(f"{name}{{{label}={value!r}}}: {label} is one of {sorted(known)}")
        return Value(kind, labels)

    def label_list(self) -> frozenset[str]:
        self.take("(")
        labels: list[str] = []
        while not self.is_next(")"):
            labels.append(self.take(kind="ident").text)
            if not self.is_next(")"):
                self.take(",")
        self.take(")")
        return frozenset(labels)

    def arguments(self) -> list[Value]:
        self.take("(")
        values: list[Value] = []
        while not self.is_next(")"):
            values.append(self.expression(0))
            if not self.is_next(")"):
                self.take(",")
        self.take(")")
        return values

    def aggregation(self) -> Value:
        name = self.take(kind="ident").text
        clause, labels = "", frozenset[str]()
        if self.is_next("by") or self.is_next("without"):
            clause = self.take().text
            labels = self.label_list()
        values = self.arguments()
        if not clause and (self.is_next("by") or self.is_next("without")):
            clause = self.take().text
            labels = self.label_list()
        wanted = ("str" if name == "count_values" else "s", "v") if name in PARAMETRIC else ("v",)
        if tuple(value.kind for value in values) != wanted:
            raise PromQLError(f"{name}() takes {wanted}, got {[v.kind for v in values]}")
        given = values[-1].labels
        self.missing_labels(f"{name} {clause}{sorted(labels)}", labels, given)
        kept = labels if clause == "by" else given - labels if clause == "without" else frozenset()
        if name in ("topk", "bottomk", "limitk", "limit_ratio"):
            kept = given
        if name == "count_values":
            kept |= {"value"}
        return Value("v", kept)

    def call(self) -> Value:
        name = self.take(kind="ident").text
        values = self.arguments()
        wanted = FUNCTIONS[name]
        required = [kind for kind in wanted if not kind.endswith("?")]
        if not len(required) <= len(values) <= len(wanted) or any(
            value.kind != kind.rstrip("?") for value, kind in zip(values, wanted, strict=False)
        ):
            raise PromQLError(f"{name}() takes {wanted}, got {[v.kind for v in values]}")
        vectors = [value for value in values if value.kind in ("v", "m")]
        labels = vectors[0].labels if vectors else frozenset()
        if name in ("scalar", "time"):
            return Value("s")
        if name == "histogram_quantile":
            self.missing_labels("histogram_quantile (buckets)", {"le"}, labels)
            return Value("v", labels - {"le"})
        if name in ("absent", "absent_over_time"):
            return Value("v", frozenset())
        return Value("v", labels)

    def missing_labels(self, where: str, labels: Iterable[str], available: frozenset[str]) -> None:
        if self.unknown_series:
            return
        for label in sorted(set(labels) - available):
            self.problem(f"{where}: no series in scope has the label {label!r}")


def read(expr: str, series: Mapping[str, frozenset[str]] | None = None) -> Reading:
    """The selectors of ``expr`` and what is wrong with the names and labels it uses.

    ``series`` defaults to what the daemons export plus Prometheus's ``up``. Raises
    :class:`PromQLError` when ``expr`` cannot be read at all.
    """
    if series is None:
        series = {**exported_series(), **PROMETHEUS_SERIES}
    parser = _Parser(expr, series)
    parser.parse()
    return parser.reading


def problems(expr: str, series: Mapping[str, frozenset[str]] | None = None) -> list[str]:
    """What is wrong with ``expr``: unknown series, labels and label values, groupings
    by labels the aggregated series lack, vector matches that cannot match; [] when none.
    """
    try:
        return read(expr, series).problems
    except PromQLError as error:
        return [f"unreadable: {error}"]
