package org.pagedkv.demo.core

import java.io.File
import java.io.InputStream
import java.security.MessageDigest

/**
 * Where the app's model lives and how one is imported, checked against its manifest. Plain JVM
 * (java.io + MessageDigest): the Android layer only opens the picked files' streams.
 *
 * A model dir holds pagedkv.json, pagedkv.json.sha256 (the manifest's own digest), the .pte and the
 * tokenizer files the manifest names: exactly what `pagedkv deploy` pushes.
 */
object ModelFiles {
    const val MANIFEST = "pagedkv.json"
    const val DIGEST = "pagedkv.json.sha256"
    private val SAFE_NAME = Regex("[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")

    class ImportError(msg: String) : Exception(msg)

    data class Listing(val pte: String, val pteSha256: String?, val tokenizerFiles: List<String>) {
        /** Every file of the model, in the order they are copied (the manifest first). */
        val files: List<String> get() = (listOf(MANIFEST, DIGEST, pte) + tokenizerFiles).distinct()
    }

    fun sha256(input: InputStream): String {
        val md = MessageDigest.getInstance("SHA-256")
        val buf = ByteArray(1 shl 16)
        input.use {
            while (true) {
                val n = it.read(buf)
                if (n < 0) break
                md.update(buf, 0, n)
            }
        }
        return md.digest().joinToString("") { "%02x".format(it) }
    }

    fun sha256(file: File): String = sha256(file.inputStream())

    private fun safe(name: Any?, what: String): String {
        if (name !is String || !SAFE_NAME.matches(name))
            throw ImportError("the manifest's $what ${name.toString().take(60)} is not a plain file name: re-export the model.")
        return name
    }

    /** The files pagedkv.json names, checked: a .pte, tokenizer.json, plain names only. */
    fun parseManifest(text: String): Listing {
        val m = try {
            MiniJson.parse(text) as? Map<*, *>
        } catch (e: MiniJson.Error) {
            throw ImportError("pagedkv.json is not valid JSON (${e.message}): re-export the model.")
        } ?: throw ImportError("pagedkv.json is not a JSON object: re-export the model.")
        val pte = ((m["artifacts"] as? Map<*, *>)?.get("pte") as? Map<*, *>)
            ?: throw ImportError("pagedkv.json has no .pte artifact: export with `pagedkv export --format pte`.")
        val sha = pte["sha256"] as? String
        val tok = (m["tokenizer_files"] as? List<*>)?.map { safe(it, "tokenizer file") } ?: emptyList()
        if ("tokenizer.json" !in tok) throw ImportError("pagedkv.json lists no tokenizer.json: re-export the model.")
        return Listing(safe(pte["file"], ".pte file"), sha, tok)
    }

    /** Checks a model dir: the manifest against its digest, every named file present, the .pte's sha256. */
    fun check(dir: File): Listing {
        val manifest = File(dir, MANIFEST)
        if (!manifest.isFile) throw ImportError("no $MANIFEST in ${dir.path}: deploy or import a model.")
        val digest = File(dir, DIGEST)
        if (digest.isFile) {
            val want = digest.readText().trim().split(Regex("\\s+")).firstOrNull()
            if (want != sha256(manifest))
                throw ImportError("$MANIFEST does not match $DIGEST (edited or half-copied): import the model again.")
        }
        val listing = parseManifest(manifest.readText())
        for (n in listing.files) {
            if (n == DIGEST && !digest.isFile) continue  // older exports had no digest file
            if (!File(dir, n).isFile) throw ImportError("$n is missing from ${dir.path}: import the whole model dir again.")
        }
        val sha = listing.pteSha256
        if (sha != null && sha256(File(dir, listing.pte)) != sha)
            throw ImportError("${listing.pte} does not match the sha256 in $MANIFEST: import the model again.")
        return listing
    }

    /**
     * Imports a model into [filesDir]/model: [open] gives a stream for a file name of the picked dir (null
     * if it has none). Everything goes to model.incoming first and is checked; only then does it replace
     * the old model (renames), so a failed import leaves the old one as it was.
     */
    fun import(filesDir: File, open: (String) -> InputStream?): Listing {
        val incoming = File(filesDir, "model.incoming")
        incoming.deleteRecursively()
        if (!incoming.mkdirs()) throw ImportError("cannot create ${incoming.path}")
        try {
            fun copy(name: String): Boolean {
                val src = open(name) ?: return false
                src.use { s -> File(incoming, name).outputStream().use { s.copyTo(it) } }
                return true
            }
            if (!copy(MANIFEST)) throw ImportError("the picked folder has no $MANIFEST: pick an artifacts dir made by `pagedkv export --format pte`.")
            copy(DIGEST)
            val listing = parseManifest(File(incoming, MANIFEST).readText())
            for (n in listing.files.drop(2)) {
                if (!copy(n)) throw ImportError("the picked folder has no $n: pick the whole artifacts dir.")
            }
            check(incoming)
            val model = File(filesDir, "model")
            val old = File(filesDir, "model.old")
            old.deleteRecursively()
            if (model.exists() && !model.renameTo(old)) throw ImportError("cannot move the old model aside")
            if (!incoming.renameTo(model)) {
                old.renameTo(model)
                throw ImportError("cannot move the new model into place")
            }
            old.deleteRecursively()
            return listing
        } catch (e: Throwable) {
            incoming.deleteRecursively()
            throw e
        }
    }

    /**
     * The model dir the app runs: the private one (imported, or deployed to a debuggable build) or the
     * external files dir (deployed to a release build), whichever holds a manifest; the newer when both do.
     */
    fun choose(internal: File, external: File?): File? {
        val a = File(internal, MANIFEST).takeIf { it.isFile }
        val b = external?.let { File(it, MANIFEST) }?.takeIf { it.isFile }
        return when {
            a != null && b != null -> if (b.lastModified() > a.lastModified()) external else internal
            a != null -> internal
            b != null -> external
            else -> null
        }
    }
}
