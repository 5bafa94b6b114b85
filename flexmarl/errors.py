"""The one base class of errors a user can fix (bad config, graph, task, model, data).

The CLI prints these as one line naming the file, field or node, and exits 2; anything else is
a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by the user's input, with a message that names what is at fault."""
