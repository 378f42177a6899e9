"""The small pieces sections are made of: a table cell, a labelled fact, a badge."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Badge:
    text: str
    tone: str  # ok | bad | warn | muted
    title: str = ""


@dataclass
class Cell:
    text: str
    bad: bool = False
    sort: str | None = None  # numeric sort value for the table sorter
    title: str = ""


@dataclass
class Fact:
    label: str
    value: str
    code: bool = False  # show the value as code
    tone: str = ""
