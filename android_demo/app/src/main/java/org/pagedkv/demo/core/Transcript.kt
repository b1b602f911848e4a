package org.pagedkv.demo.core

/**
 * The chat as the screen shows it: one [Turn] per user message with its streamed reply. Thread safe
 * (the runner's thread appends, the UI thread renders). Plain Kotlin, no Android imports.
 */
class Transcript {
    enum class State { QUEUED, RUNNING, DONE, STOPPED, FAILED }

    class Turn internal constructor(val id: Int, val user: String) {
        /** Set by Stop at any time: a queued turn never starts, a running one ends after its current token. */
        @Volatile var stopRequested = false
            internal set
        var state = State.QUEUED
            internal set
        internal val reply = StringBuilder()
        var note: String? = null
            internal set
        val replyText: String get() = reply.toString()
    }

    private val turns = ArrayList<Turn>()
    private val notes = ArrayList<String>()  // lines between turns (model loaded, cleared, errors)
    private var nextId = 0

    @Synchronized fun add(user: String): Turn = Turn(nextId++, user).also { turns.add(it) }

    /** The turn waiting or running, if any (one at a time: Send is disabled while it exists). */
    @Synchronized fun active(): Turn? = turns.lastOrNull()?.takeIf { it.state == State.QUEUED || it.state == State.RUNNING }

    /** Stop the active turn; returns it, or null when nothing waits or runs. */
    @Synchronized fun stop(): Turn? = active()?.also { it.stopRequested = true }

    @Synchronized fun started(turn: Turn) {
        if (turn.state == State.QUEUED) turn.state = State.RUNNING
    }

    @Synchronized fun append(turn: Turn, piece: String) {
        turn.reply.append(piece)
    }

    @Synchronized fun finish(turn: Turn, state: State, note: String? = null) {
        turn.state = state
        turn.note = note
    }

    @Synchronized fun note(line: String) {
        notes.add(line)
        if (notes.size > 50) notes.removeAt(0)
    }

    @Synchronized fun clear() {
        turns.removeAll { it.state != State.QUEUED && it.state != State.RUNNING }
        notes.clear()
    }

    @Synchronized fun size(): Int = turns.size

    /** The screen's text: notes first, then each turn with its state. */
    @Synchronized fun render(): String = buildString {
        for (n in notes) append(n).append('\n')
        if (notes.isNotEmpty() && turns.isNotEmpty()) append('\n')
        for (t in turns) {
            append("You: ").append(t.user).append('\n')
            append("Model: ").append(t.reply)
            when (t.state) {
                State.QUEUED -> append("…")
                State.RUNNING -> append("▍")
                State.STOPPED -> append(" [stopped]")
                State.FAILED -> append(" [").append(t.note ?: "failed").append(']')
                State.DONE -> {}
            }
            append("\n\n")
        }
    }
}
