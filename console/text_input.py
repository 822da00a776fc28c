"""Reading a long text from a terminal, whole.

A terminal in its normal (canonical) mode hands a program at most 4095 characters of one line and
silently drops the rest, so a context pasted at an ``input()`` prompt arrives cut. ``read_text``
switches the terminal to non-canonical mode for the length of one text, echoes what it reads
itself, and ends the text at an empty line typed by the user or at Ctrl+D. An empty line inside
a paste does not end it: the terminal is asked to mark pastes (bracketed paste), and where it
does not, an empty line is taken as the end only when no more input follows within
``PASTE_GAP_S`` (a paste arrives in one burst). From a pipe or file, one line is one text.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
from typing import TextIO

try:
    import termios
except ImportError:  # not a POSIX terminal (Windows): line input, with its limits
    termios = None  # type: ignore[assignment]

#: Seconds without input after an empty line before it counts as typed (the end of the text),
#: for terminals that do not mark pastes.
PASTE_GAP_S = 0.2
#: Terminal controls: mark pasted text with ESC[200~ ... ESC[201~ (ignored where unsupported).
BRACKETED_PASTE_ON, BRACKETED_PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"

_BACKSPACES = ("\x7f", "\b")
_CTRL_D = "\x04"


class TextBuffer:
    """The text typed or pasted so far, fed characters as they arrive; no terminal needed.

    ``feed`` returns what to echo. An Enter on an empty line is held back (``blank_pending``):
    the caller decides, by whether more input follows at once, if it ends the text or is an
    empty line inside a paste.
    """

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.blank_pending = False  # Enter on an empty line, not yet known to end the text
        self.ended = False  # Ctrl+D
        self.pasting = False  # between the terminal's bracketed-paste marks
        self._sequence: str | None = None  # the escape sequence being read, after ESC

    def feed(self, text: str) -> str:
        """Take characters; return the characters to echo."""
        echo: list[str] = []
        for ch in text:
            if self.ended:
                break
            echo.append(self._take(ch))
        return "".join(echo)

    def _take(self, ch: str) -> str:
        if self._sequence is not None:
            self._escape_sequence(ch)
            return ""
        if ch == "\x1b":
            self._sequence = ""
            return ""
        if ch == _CTRL_D:
            self.ended = True
            return ""
        if self.blank_pending:  # more came at once: that empty line was part of a paste
            self.blank_pending = False
            self.chars.append("\n")
        if ch in "\r\n":
            at_line_start = not self.chars or self.chars[-1] == "\n"
            if at_line_start and not self.pasting:
                self.blank_pending = True
            else:
                self.chars.append("\n")
            return "\n"
        if ch in _BACKSPACES:
            if self.chars and self.chars[-1] != "\n":
                self.chars.pop()
                return "\b \b"
            return ""
        if ch < " " and ch != "\t":
            return ""  # other control characters mean nothing in a text
        self.chars.append(ch)
        return ch

    def _escape_sequence(self, ch: str) -> None:
        """One character of an escape sequence (arrow keys and the like are dropped); the
        bracketed-paste marks ESC[200~ and ESC[201~ say where a paste starts and ends."""
        assert self._sequence is not None
        self._sequence += ch
        introducer = len(self._sequence) == 1 and ch in "[O"
        if not introducer and (len(self._sequence) == 1 or ch.isalpha() or ch == "~"):
            if self._sequence in ("[200~", "[201~"):
                self.pasting = self._sequence == "[200~"
            self._sequence = None

    @property
    def text(self) -> str:
        """The text so far, without surrounding blank space."""
        return "".join(self.chars).strip()


def read_text(prompt: str, stdin: TextIO | None = None, stdout: TextIO | None = None) -> str:
    """One text from the user: a whole paste or several typed lines, however long.

    Args:
        prompt: Shown before reading.
        stdin: Where to read (default ``sys.stdin``); a terminal gets the non-canonical reader.
        stdout: Where the prompt and echo go (default ``sys.stdout``).

    Returns:
        The text, stripped; empty if the user entered nothing.

    Raises:
        EOFError: Ctrl+D, or the end of input, before any text.
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if termios is None or not stdin.isatty():
        stdout.write(prompt)
        stdout.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        return valid_text(line).strip()
    return _read_terminal(prompt, stdin.fileno(), stdout)


def _read_terminal(prompt: str, fd: int, stdout: TextIO) -> str:
    """Read from the terminal ``fd`` in non-canonical mode, restoring its mode afterwards."""
    saved = termios.tcgetattr(fd)
    raw = termios.tcgetattr(fd)
    raw[3] &= ~(termios.ICANON | termios.ECHO)  # keep ISIG: Ctrl+C still interrupts
    raw[6][termios.VMIN], raw[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, raw)
    try:
        # only now the prompt: what is typed from here on is read whole; and ask the terminal
        # to mark pastes, so that their empty lines never end the text
        stdout.write(BRACKETED_PASTE_ON + prompt)
        stdout.flush()
        buffer = _collect(fd, stdout)
    finally:
        stdout.write(BRACKETED_PASTE_OFF)
        stdout.flush()
        termios.tcsetattr(fd, termios.TCSANOW, saved)
    if buffer.ended and not buffer.text:
        stdout.write("\n")
        raise EOFError
    return buffer.text


def _collect(fd: int, stdout: TextIO) -> TextBuffer:
    """Feed the terminal's bytes to a TextBuffer until the text ends."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buffer = TextBuffer()
    while not buffer.ended:
        data = os.read(fd, 65536)
        if not data:  # the terminal hung up
            buffer.ended = True
            break
        stdout.write(buffer.feed(decoder.decode(data)))
        stdout.flush()
        if buffer.blank_pending and not select.select([fd], [], [], PASTE_GAP_S)[0]:
            break  # an empty line with nothing after it: typed, so the text is complete
    return buffer


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate as U+FFFD: bytes that are not UTF-8 (which a C-locale
    stdin hands over as surrogates) cannot be sent, and the pasted-text reader replaces them too."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
