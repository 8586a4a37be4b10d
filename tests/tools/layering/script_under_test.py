"""Where the layering tests find the script they test and the tree it checks.

Under Bazel the script is a runfile that links to the checkout's own file; under
plain pytest it is the checkout's file beside these tests. Either way the tree
is the top of the checkout the script sits in (two folders up from it).
"""
import os


def locate(name):
    """(script, tree) for tools/layering/<name>."""
    runfiles = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
    link = os.path.join(runfiles, "tools", "layering", name)
    if not os.path.exists(link):  # run by plain pytest from the checkout
        link = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools", "layering", name)
    script = os.path.realpath(link)
    return script, os.path.dirname(os.path.dirname(os.path.dirname(script)))
