"""Soak runs: simulated callers over real sockets against a running server (docs/soak.md).

    speaker.py   the simulated loudspeaker of one answer: jitter buffer, deadlines, lateness, underruns
    callers.py   one caller per transport (WebSocket pcm16, WebSocket Opus, WebRTC, Twilio), one script
    run.py       the run: server (started or given), callers, sampling, accounting; `duplex soak`
    report.py    percentiles per transport, the JSON report and its plot
"""
