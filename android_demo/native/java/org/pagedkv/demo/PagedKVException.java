package org.pagedkv.demo;

/** An error from the native runner; {@link #code} says which kind (see the constants). */
public class PagedKVException extends RuntimeException {
    public static final int ARTIFACT = 1, ALLOCATION = 2, POOL_EXHAUSTED = 3, STATE = 4, MODEL = 5, ARGUMENT = 6;
    public final int code;

    public PagedKVException(int code, String message) {
        super(message);
        this.code = code;
    }
}
