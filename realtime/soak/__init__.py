"""Soak runs: simulated callers over real sockets against a running server (docs/soak.md).

    speaker.py         the simulated loudspeaker of one answer: jitter buffer, deadlines, lateness, underruns
    callers.py         one caller per transport (WebSocket pcm16, WebSocket Opus, WebRTC, Twilio), one script
    speech.py          the callers' speech: espeak-ng sentences at 16 kHz
    server_process.py  `duplex serve` started for a run, and its probes (health, metrics, RSS, fds)
    run.py             the run: server (started or given), callers, sampling, accounting; `duplex soak`
    faults.py          the fault runs: misbehaving clients and an engine stall beside a witness caller
    report.py          percentiles per transport, the JSON report and its plot
"""
