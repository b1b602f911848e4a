package org.pagedkv.demo;

/** The KV block pool has too few free blocks for the request; nothing was changed. Clear a conversation. */
public class PoolExhaustedException extends PagedKVException {
    public PoolExhaustedException(int code, String message) {
        super(code, message);
    }
}
