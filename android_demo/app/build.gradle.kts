import org.jetbrains.kotlin.gradle.dsl.JvmTarget

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// The native runner (../native) is built by CMake with ExecuTorch v1.5.1 compiled from source and linked
// statically into libpagedkv_runner.so (PAGEDKV_EXECUTORCH=source): one ExecuTorch per process, our kernels
// registered in it. No executorch-android AAR: its libexecutorch.so exports only JNI symbols (README).
val python: String = (project.findProperty("pagedkv.python") as String?).orEmpty()
val executorchSourceDir: String = (project.findProperty("pagedkv.executorchSourceDir") as String?).orEmpty()

android {
    namespace = "org.pagedkv.demo"
    compileSdk = 35
    ndkVersion = "28.2.13676358"  // NDK r28c

    defaultConfig {
        applicationId = "org.pagedkv.demo"
        minSdk = 28
        targetSdk = 35
        versionCode = 2
        versionName = "0.2.0"
        ndk { abiFilters += listOf("arm64-v8a") }
        externalNativeBuild {
            cmake {
                arguments += listOf(
                    "-DPAGEDKV_EXECUTORCH=source",
                    "-DEXECUTORCH_SOURCE_DIR=$executorchSourceDir",
                    "-DPYTHON_EXECUTABLE=$python",
                    "-DPAGEDKV_RUNNER_TESTS=OFF",
                    "-DPAGEDKV_RUNNER_CLI=OFF",
                    "-DANDROID_STL=c++_static",
                    "-DANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES=ON",
                    "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-z,max-page-size=16384",
                )
                targets += listOf("pagedkv_runner", "pagedkv_jni")
            }
        }
    }
    externalNativeBuild {
        cmake {
            path = file("../native/CMakeLists.txt")
            version = "3.31.6"
        }
    }
    sourceSets["main"].java.srcDirs("src/main/java", "../native/java")
    buildTypes {
        release {
            isMinifyEnabled = false
            signingConfig = signingConfigs.getByName("debug")  // a demo: sign release builds with the debug key
        }
    }
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    packaging { jniLibs { useLegacyPackaging = false } }  // stored uncompressed, 16 KB aligned in the APK
}

kotlin { compilerOptions { jvmTarget.set(JvmTarget.JVM_17) } }

dependencies {
    implementation("androidx.appcompat:appcompat:1.7.0")
}
