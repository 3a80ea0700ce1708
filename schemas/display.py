"""How text that the program did not write (an operator's flag, a record, a ledger row, a pod's
or a controller's message) is shown to a reader: :func:`shown`, the one display sanitizer of
every package (D104).

A contract shared by ``deploy`` (``flywheel status``, the on-call commands) and ``modelstore``
(the controller's heartbeat, whose error a reader keeps for display), so it lives in
``schemas/``: ``deploy`` imports ``modelstore``, so ``modelstore`` may not import ``deploy``.
Standard library only: a pod, the learner and the controller import ``modelstore`` without
the CLI's packages.
"""

from __future__ import annotations


def shown(s: str) -> str:
    """``s`` as a terminal may print it: every character that is not printable
    (``str.isprintable``: C0 controls with ESC, NUL, newline and tab, DEL, C1 controls with
    the 8-bit CSI U+009B, format characters such as bidi overrides, lone surrogates, line
    and paragraph separators, spaces other than " ") written as ``repr`` writes it: ``\\x1b``,
    ``\\n``, ``\\x9b``, ``\\u202e`` (4 to 10 printable characters each). Printable text,
    backslashes included, is unchanged, so the escapes are for a reader, not a parser: the
    exact value is what ``-o json`` holds. Every string an operator, a record, a ledger, a
    pod or a controller supplies goes through it before it is printed, and before any cut, so
    a cut never splits an escape sequence into one a terminal acts on.

    Args:
        s: any ``str`` (any length; lone surrogates included).

    Returns:
        A ``str`` of printable characters only (``shown(s).isprintable()`` is True), at least as
        long as ``s``; ``s`` itself when it is printable already.
    """
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
