plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// ExecuTorch's runtime for arm64 comes from the executorch-android AAR (libexecutorch.so); the
// native runner (../native) compiles against the same version's headers from the pip wheel.
val executorchVersion = "1.5.1"
val executorchRoot: String = (project.findProperty("pagedkv.executorchRoot") as String?).orEmpty()
val aarJniDir = layout.buildDirectory.dir("executorch-aar/jni").get().asFile

val executorchAar by configurations.creating

android {
    namespace = "org.pagedkv.demo"
    compileSdk = 34
    ndkVersion = "26.3.11579264"

    defaultConfig {
        applicationId = "org.pagedkv.demo"
        minSdk = 28
        targetSdk = 34
        versionCode = 1
        versionName = "0.1.0"
        ndk { abiFilters += listOf("arm64-v8a") }
        externalNativeBuild {
            cmake {
                arguments += listOf(
                    "-DPAGEDKV_RUNNER_TESTS=OFF",
                    "-DEXECUTORCH_ROOT=$executorchRoot",
                    "-DEXECUTORCH_LIBS=${aarJniDir}/arm64-v8a/libexecutorch.so",
                    "-DANDROID_STL=c++_shared",
                )
                cppFlags += listOf("-std=c++17")
            }
        }
    }
    externalNativeBuild {
        cmake {
            path = file("../native/CMakeLists.txt")
            version = "3.22.1"
        }
    }
    sourceSets["main"].java.srcDirs("src/main/java", "../native/java")
    buildTypes {
        release {
            isMinifyEnabled = false
        }
    }
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions { jvmTarget = "17" }
    packaging { jniLibs { pickFirsts += listOf("**/libc++_shared.so") } }
}

dependencies {
    implementation("org.pytorch:executorch-android:$executorchVersion")
    executorchAar("org.pytorch:executorch-android:$executorchVersion@aar")
    implementation("androidx.appcompat:appcompat:1.7.0")
    implementation("androidx.lifecycle:lifecycle-runtime-ktx:2.8.4")
    implementation("org.jetbrains.kotlinx:kotlinx-coroutines-android:1.8.1")
}

// Unpack the AAR's jni/ so CMake can link the runner against its libexecutorch.so.
val unpackExecutorchAar by tasks.registering(Copy::class) {
    from({ executorchAar.map { zipTree(it) } }) { include("jni/**") }
    into(aarJniDir.parentFile)
}
tasks.configureEach {
    if (name.startsWith("configureCMake") || name.startsWith("buildCMake")) dependsOn(unpackExecutorchAar)
}
