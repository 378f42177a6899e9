"""The fixes written as edits of the user's lines (`fix.edits`): each module builds them for one kind of cause.

`codefix.py` is what they share: find the culprit's call on its source line with `ast`, rewrite it, and check the
edit (the rewrite of one line). The others build on it: `crossline.py` a fix that spans lines, `bcefix.py` and
`lsmfix.py` a hand-written BCE or log(softmax) made across functions, `segfix.py` the segment softmax, `exproot.py`
a clamp at the log-scale value several exps take, `upcast.py` a float16 product computed in float32, `datafix.py`
bad rows left out where the batch enters the code, `construction.py` the line that built a module, and
`sitefix.py` the line that made the optimizer, scheduler or autocast (capture/sites.py). The rules
(diagnose/rules/) and the fix table (diagnose/fixes.py) call them; none of them replays anything.
"""
