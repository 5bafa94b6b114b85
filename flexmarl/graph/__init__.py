"""Multi-agent Execution Graph."""

from flexmarl.graph.meg import MEG, EpisodeContext, GraphError, Node, NodePrompt, TextPrompt
from flexmarl.graph.task import Task, load_task

__all__ = ["MEG", "EpisodeContext", "GraphError", "Node", "NodePrompt", "Task", "TextPrompt",
           "load_task"]
